"""Run under `accelerate launch --config_file configs/accelerate/cpu_2proc_fsdp2.yaml` (2 CPU processes, gloo,
Accelerate's FSDP2 path as common.parallel.accelerator.make_accelerator switches it on): the prepared model reduces its
gradients in float32, and `engine_weights` streamed from the sharded model equals the stream of the unsharded model
tensor for tensor (plain and LoRA), with a fingerprint that is the same on both ranks, unchanged by a stream and
changed by an optimizer step. Used by tests/*/test_distributed.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from common.core import chat
from common.core import models as M  # noqa: E402
from common.parallel.accelerator import make_accelerator  # noqa: E402
from common.parallel.weight_stream import _full_by_pieces, engine_weights, is_sharded, trainable_fingerprint  # noqa: E402

path, lora = sys.argv[1], sys.argv[2] == "lora"
acc = make_accelerator()
tok = chat.load_tokenizer(path)
model = M.load_causal_lm(path, tok)
if lora:  # random B (init_lora_weights=False), so the merge really changes the weights
    torch.manual_seed(0)  # the same factors on both ranks (fully_shard keeps each rank's own slice)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, cfg)
reference = {k: v.clone() for k, v in engine_weights(model, torch.bfloat16)}
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
model, opt = acc.prepare(model, opt)
assert is_sharded(model) and any(isinstance(p, DTensor) for p in model.parameters())
root = model if hasattr(model, "_get_fsdp_state") else next(m for m in model.modules() if hasattr(m, "_get_fsdp_state"))
assert root._get_fsdp_state()._mp_policy.reduce_dtype == torch.float32, root._get_fsdp_state()._mp_policy

before = trainable_fingerprint(model)
streamed = dict(engine_weights(model, torch.bfloat16))
assert list(streamed) == list(reference), (list(streamed)[:5], list(reference)[:5])
bad = [k for k in reference if not torch.equal(streamed[k], reference[k])]
assert not bad, [(k, (streamed[k].float() - reference[k].float()).abs().max().item()) for k in bad[:5]]
assert all(v.dtype == torch.bfloat16 for v in streamed.values() if v.is_floating_point())
assert torch.equal(trainable_fingerprint(model), before)  # streaming changes nothing
everyone = [torch.zeros_like(before) for _ in range(acc.num_processes)]
torch.distributed.all_gather(everyone, before)
assert all(torch.equal(e, before) for e in everyone)  # one answer on every rank: they decide to push together
ids = torch.tensor([[1, 2, 3, 4]])
loss = model(input_ids=ids, labels=ids).loss
acc.backward(loss)
opt.step()
assert not torch.equal(trainable_fingerprint(model), before)
# the gather in pieces of rows (weight_stream._full_by_pieces) equals full_tensor() for uneven shards and pieces
for shape in [(7, 3), (1001, 8), (1, 5), (3,), (5, 2, 3)]:
    torch.manual_seed(1)
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.randn(*shape))
    fully_shard(holder)
    assert torch.equal(_full_by_pieces(holder.w.detach(), piece_bytes=96), holder.w.detach().full_tensor()), shape
print(f"rank {acc.process_index}: FSDP2 stream OK ({'lora' if lora else 'full'}, {len(streamed)} tensors)")
