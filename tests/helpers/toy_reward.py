"""A toy reward a tiny random model can learn fast (used by the learning tests).

S = the tokens whose (tied) embedding has a positive projection on a fixed direction u. Raising the
probability of sampled tokens in S moves the final hidden state along u, which raises every token
in S: a linearly learnable half of the vocabulary. reward = fraction of response tokens in S.
The model folder comes from the environment variable TOY_MODEL.
"""

import os
from functools import lru_cache

import torch


@lru_cache(maxsize=1)
def _setup(path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    emb = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]  # (V, H)
    u = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    return AutoTokenizer.from_pretrained(path), (emb @ u > 0)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    tok, in_s = _setup(os.environ["TOY_MODEL"])
    ids = tok(solution_str, add_special_tokens=False)["input_ids"]
    frac = float(in_s[ids].float().mean()) if ids else 0.0
    return {"score": frac, "acc": float(frac > 0.9)}
