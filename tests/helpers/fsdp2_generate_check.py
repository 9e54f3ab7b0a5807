"""Run under torchrun (2 CPU processes, gloo): generation from an FSDP2-sharded model through
common.parallel.sharded.unwrap_for_generation equals generation from the unsharded model, and the
parameters are sharded again afterwards. Used by tests/*/test_distributed.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from common.core import chat
from common.core import models as M  # noqa: E402
from common.core.generation import generate, tokenize_queries  # noqa: E402
from common.parallel.sharded import _reshard_setting, unwrap_for_generation  # noqa: E402

dist.init_process_group("gloo")
path = sys.argv[1]
tok = chat.load_tokenizer(path)
model = M.load_causal_lm(path, tok).eval()
q, qm = tokenize_queries(tok, [chat.apply_chat(tok, "hello"), chat.apply_chat(tok, "count to three")])
plain = generate(model, tok, q, qm, 8, temperature=1.0, seeds=[1, 2])
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model, reshard_after_forward=False)  # as Accelerate does for the root: the settings must survive
before = [_reshard_setting(m) for m in model.modules() if hasattr(m, "unshard")]
p = model.model.layers[0].self_attn.q_proj.weight
assert isinstance(p, DTensor) and p.to_local().shape[0] < p.shape[0]  # really sharded
with unwrap_for_generation(None, model) as gen_model:
    sharded = generate(gen_model, tok, q, qm, 8, temperature=1.0, seeds=[1, 2])
p = model.model.layers[0].self_attn.q_proj.weight
assert isinstance(p, DTensor) and p.to_local().shape[0] < p.shape[0]  # resharded after the block
assert [_reshard_setting(m) for m in model.modules() if hasattr(m, "unshard")] == before  # per-unit settings restored
assert before[0][1] != before[-1][1]  # (the layers and the root really differ, so the check can fail)
assert torch.equal(plain.responses, sharded.responses), (plain.responses, sharded.responses)
assert torch.allclose(plain.logprobs, sharded.logprobs, atol=1e-5)
print(f"rank {dist.get_rank()}: FSDP2 generation OK")
dist.destroy_process_group()
