"""Run under `accelerate launch --config_file configs/accelerate/cpu_2proc_zero3.yaml` (2 CPU processes, gloo,
DeepSpeed ZeRO-3): generation through common.parallel.sharded.unwrap_for_generation runs no DeepSpeed module hook (they
are removed for the rollout and put back after it), samples what the unsharded model samples, and the training
step after it (hooks back: parameters fetched per module) still works. Used by tests/*/test_distributed.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch  # noqa: E402

from common.core import chat
from common.core import models as M  # noqa: E402
from common.core.generation import generate, tokenize_queries  # noqa: E402
from common.parallel.accelerator import configure_deepspeed, make_accelerator  # noqa: E402
from common.parallel.sharded import unwrap_for_generation

path = sys.argv[1]
accelerator = make_accelerator()
tok = chat.load_tokenizer(path)
model = M.load_causal_lm(path, tok)
q, qm = tokenize_queries(tok, [chat.apply_chat(tok, "hello"), chat.apply_chat(tok, "count to three")])
configure_deepspeed(accelerator, micro_batch_size=2, accumulation_steps=1, max_grad_norm=1.0)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
engine, opt = accelerator.prepare(model, opt)
offload = engine.optimizer.parameter_offload
calls = []
real = offload.pre_sub_module_forward_function
offload.pre_sub_module_forward_function = lambda module: (calls.append(module), real(module))[1]
hooks = len(offload.forward_hooks)
assert hooks > 0 and engine.module.model.layers[0].mlp.up_proj.weight.numel() == 0  # really partitioned
engine.eval()
with deepspeed.zero.GatheredParameters(list(engine.parameters())):  # the route before: the hooks stay on
    plain = generate(engine.module, tok, q, qm, 8, temperature=1.0, seeds=[1, 2])
before, calls[:] = len(calls), []
assert before >= 8 * len(list(engine.module.modules())) // 2, before  # every decoding step ran them
with unwrap_for_generation(accelerator, engine) as unwrapped:
    assert offload.forward_hooks == []
    out = generate(unwrapped, tok, q, qm, 8, temperature=1.0, seeds=[1, 2])
assert calls == [], len(calls)  # not one hook call over the 8 decoding steps
assert torch.equal(out.responses, plain.responses), (out.responses, plain.responses)
assert len(offload.forward_hooks) == hooks and engine.module.model.layers[0].mlp.up_proj.weight.numel() == 0
engine.train()
loss = engine(input_ids=out.query_responses, labels=out.query_responses).loss  # hooks back: fetched per module
engine.backward(loss)
engine.step()
assert len(calls) > 0 and torch.isfinite(loss)
print(
    f"ZeRO-3 generation OK: {hooks} hooks off for the rollout (before: {before} hook calls over 8 tokens), "
    f"{len(calls)} hook calls in the training step"
)
