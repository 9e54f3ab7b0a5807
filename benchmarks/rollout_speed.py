"""Generation speed: per-sample seeded sampling (common.core.generation.generate) vs transformers' own
batch sampling, and the recompute forward, for a few batch sizes.

    python benchmarks/rollout_speed.py [--model smollm2-135m-instruct] [--max-new-tokens 48]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.core import (
    chat,  # noqa: E402
    defaults,
)
from common.core import models as M
from common.core.forwards import forward_logprobs  # noqa: E402
from common.core.generation import generate, sequence_attention_mask, tokenize_queries


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=defaults.DEFAULT_MODEL)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16])
    a = p.parse_args()
    tok = chat.load_tokenizer(a.model)
    model = M.load_causal_lm(a.model, tok).eval()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(dev)
    print(
        "| batch | seeded sampler s | HF sampling s | tokens/s (seeded) | recompute forward s |\n|---|---|---|---|---|"
    )
    for b in a.batch_sizes:
        q, qm = tokenize_queries(tok, [chat.apply_chat(tok, f"Count to {i + 3}.") for i in range(b)], dev)
        t0 = time.time()
        ro = generate(model, tok, q, qm, a.max_new_tokens, 1.0, seeds=list(range(b)))
        seeded = time.time() - t0
        t0 = time.time()
        with torch.no_grad():
            model.generate(
                input_ids=q,
                attention_mask=qm,
                max_new_tokens=a.max_new_tokens,
                do_sample=True,
                pad_token_id=tok.pad_token_id,
                min_new_tokens=ro.responses.shape[1],
            )
        hf = time.time() - t0
        t0 = time.time()
        with torch.no_grad():
            forward_logprobs(model, ro.query_responses, sequence_attention_mask(qm, ro.responses.shape[1]), q.shape[1])
        fwd = time.time() - t0
        print(
            f"| {b} | {seeded:.2f} | {hf:.2f} | {ro.response_mask.sum().item() / seeded:.0f} | {fwd:.2f} |", flush=True
        )


if __name__ == "__main__":
    main()
