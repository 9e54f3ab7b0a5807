"""Run under torchrun (2 CPU processes, gloo): the vocabulary-parallel log-softmax (common.core.ops under
sharded_logits) on each rank's half of the vocabulary equals numpy's log-softmax and entropy over the
whole rows, and its gradient equals the closed form, also from numpy. Used by tests/multi_process/test_tensor_parallel.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.core import ops  # noqa: E402
from common.core import process_groups as parallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
parallel.STATE.tp_group = dist.group.WORLD  # as make_accelerator(tp_size=2) sets it
g = torch.Generator().manual_seed(0)
B, T, V, temp = 5, 3, 12, 0.7  # 5 rows: more than one chunk of 4
z = torch.randn(B, T, V, generator=g) * 4
index = torch.randint(0, V, (B, T), generator=g)
index[0, 0], index[0, 1] = 0, V - 1  # the first and the last id: each rank's block edge
w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)  # d loss / d logp, d loss / d H

# numpy reference over the whole rows (float64)
zn = z.numpy().astype(np.float64) / temp
logp_all = zn - zn.max(-1, keepdims=True)
logp_all -= np.log(np.exp(logp_all).sum(-1, keepdims=True))
p = np.exp(logp_all)
ref_lp = np.take_along_axis(logp_all, index.numpy()[..., None], -1)[..., 0]
ref_ent = -(p * logp_all).sum(-1)
onehot = np.eye(V)[index.numpy()]
ez = (p * zn).sum(-1, keepdims=True)
# loss = sum(w_lp * logp + w_ent * H); d/d(z/temp): w_lp (onehot - p) - w_ent p (z - E[z]); then / temp
ref_grad = (w_lp.numpy()[..., None] * (onehot - p) - w_ent.numpy()[..., None] * p * (zn - ez)) / temp

block = slice(rank * V // world, (rank + 1) * V // world)
mine = z[..., block].clone().requires_grad_(True)
with parallel.sharded_logits():
    lp, ent = ops.logprobs_and_entropy(mine, index, temperature=temp, entropy_grad=True)
    lp_only = ops.selective_log_softmax(mine.detach(), index, temperature=temp)
np.testing.assert_allclose(lp.detach().numpy(), ref_lp, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(ent.detach().numpy(), ref_ent, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(lp_only.numpy(), ref_lp, rtol=1e-5, atol=1e-5)
(w_lp * lp + w_ent * ent).sum().backward()
np.testing.assert_allclose(mine.grad.numpy(), ref_grad[..., block], rtol=1e-4, atol=1e-6)
# a detached entropy (the default statistic): the log-prob gradient alone
mine.grad = None
with parallel.sharded_logits():
    lp, ent = ops.logprobs_and_entropy(mine, index, temperature=temp)
assert not ent.requires_grad
(w_lp * lp).sum().backward()
ref_lp_grad = w_lp.numpy()[..., None] * (onehot - p) / temp
np.testing.assert_allclose(mine.grad.numpy(), ref_lp_grad[..., block], rtol=1e-4, atol=1e-6)
# outside the block: the helpers take whole rows again
np.testing.assert_allclose(ops.selective_log_softmax(z, index, temperature=temp).numpy(), ref_lp, rtol=1e-5, atol=1e-5)
print(f"rank {rank}: vocab-parallel log-softmax ok")

# A tiny model under --tp-size 2 (argv[1]): the policy's log-probs and entropies (forward_logprobs, where the
# head keeps each rank's vocabulary block) and the gradient of every weight equal one whole model's.
if len(sys.argv) > 1:
    from torch.distributed.tensor import DTensor

    from common.core import models
    from common.core.forwards import forward_logprobs
    from common.parallel.accelerator import make_accelerator

    acc = make_accelerator(tp_size=2)
    sharded = models.load_causal_lm(sys.argv[1], dtype="float32")
    parallel.STATE.tp_mesh = None  # the next model loads whole
    whole = models.load_causal_lm(sys.argv[1], dtype="float32")
    qr = torch.randint(0, 1000, (3, 10), generator=g)
    attn = torch.ones_like(qr)
    attn[0, :2] = 0  # a left-padded prompt
    V = whole.config.vocab_size
    with parallel.sharded_logits():
        assert sharded(input_ids=qr, attention_mask=attn).logits.shape == (3, 10, V // 2)  # never (B, T, V)
    assert sharded(input_ids=qr, attention_mask=attn).logits.shape == (3, 10, V)  # outside: gathered (sampling)
    results = []
    for m, group in ((sharded, acc.tp_mesh["tp"].get_group()), (whole, None)):
        parallel.STATE.tp_group = group  # the whole model: sharded_logits() is a no-op
        lp, ent = forward_logprobs(m, qr, attn, P=4, temperature=0.9, with_entropy=True, entropy_grad=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach()))
    np.testing.assert_allclose(results[0][0].numpy(), results[1][0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[0][1].numpy(), results[1][1].numpy(), rtol=1e-5, atol=1e-5)
    grads = dict(whole.named_parameters())
    for name, p in sharded.named_parameters():
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        np.testing.assert_allclose(got.numpy(), grads[name].grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    print(f"rank {rank}: TP model log-probs, entropies and gradients ok")
