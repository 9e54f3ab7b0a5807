"""Run under torchrun (2 CPU processes, gloo): statistics with distributed=True over two ranks'
slices equal numpy's over the whole batch. Used by tests/*/test_distributed.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.core.ops import all_sum, masked_mean, masked_var, masked_whiten  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "algos"))
from grpo_llm import compute_advantages  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
g = torch.Generator().manual_seed(0)
x = torch.randn(6, 5, generator=g) * 3 + 2  # the global batch, same on both ranks
mask = (torch.rand(6, 5, generator=g) > 0.4).float()
mask[:, 0] = 1
# uneven split: rank 0 holds rows 0-1 (few tokens), rank 1 rows 2-5
rows = slice(0, 2) if rank == 0 else slice(2, 6)
xl, ml = x[rows], mask[rows]
sel = x.numpy()[mask.numpy().astype(bool)].astype(np.float64)

assert all_sum(torch.tensor(float(rank + 1))).item() == 3.0
np.testing.assert_allclose(masked_mean(xl, ml, distributed=True).item(), sel.mean(), rtol=1e-5)
np.testing.assert_allclose(masked_var(xl, ml, distributed=True).item(), sel.var(ddof=1), rtol=1e-5)
w = masked_whiten(xl, ml, distributed=True)
np.testing.assert_allclose(
    w.numpy()[ml.numpy().astype(bool)],
    ((x.numpy()[rows] - sel.mean()) / sel.std(ddof=1))[ml.numpy().astype(bool)],
    atol=1e-5,
)
w = masked_whiten(xl, ml, shift_mean=False, distributed=True)
np.testing.assert_allclose(
    w.numpy()[ml.numpy().astype(bool)],
    ((x.numpy()[rows] - sel.mean()) / sel.std(ddof=1) + sel.mean())[ml.numpy().astype(bool)],
    atol=1e-5,
)
assert not np.isclose(masked_mean(xl, ml).item(), sel.mean())  # the local statistic really differs

s = torch.tensor([1.0, 0, 3, 1, 5, 5, 0, 2])  # 4 groups of 2; rank 0 holds groups 0-1, rank 1 groups 2-3
sl = s[:4] if rank == 0 else s[4:]
centered = np.array([0.5, -0.5, 1, -1, 0, 0, -1, 1])
np.testing.assert_allclose(
    compute_advantages(sl, 2, "group-mean", "batch").numpy(),
    (centered / (np.std(s.numpy(), ddof=1) + 1e-6))[:4]
    if rank == 0
    else (centered / (np.std(s.numpy(), ddof=1) + 1e-6))[4:],
    atol=1e-6,
)
# the token-mean divisor: rank 0 holds 3 tokens, rank 1 holds 5; each divides by 8 / 2
from common.core.ops import global_mean_divisor  # noqa: E402

assert global_mean_divisor(torch.tensor(3.0 if rank == 0 else 5.0)).item() == 4.0
print(f"rank {rank}: distributed stats OK")
dist.destroy_process_group()
