"""algos/grpo_llm.py: every variant's advantage and loss aggregation by hand; end to end; learning; resume."""

import sys

import grpo_llm as G  # noqa: E402
import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))

# --------------------------------------------------------------------------- the 2026 loss family (issue 34)
# hand-made log-probs: row 0 near-on-policy, row 1 a zero-advantage group member, row 2 extreme ratios,
# row 3 fully masked; advantages (b, 1); every formula below is recomputed in numpy, float64
LP = torch.tensor(
    [[-1.0, -2.0, -0.5], [-0.3, -0.2, -1.5], [-0.1, -90.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64
)

OLD = torch.tensor(
    [[-1.1, -1.9, -0.5], [-0.3, -0.4, -1.0], [-80.0, -0.1, -3.0], [-2.0, -0.5, -1.0]], dtype=torch.float64
)

ADV = torch.tensor([[1.5], [0.0], [-0.7], [2.0]], dtype=torch.float64)

MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)


def _grad(fn):
    """(per-token loss, clipped, d sum(loss * mask) / d logprobs) of a loss function of logprobs."""
    lp = LP.clone().requires_grad_(True)
    loss, stats = fn(lp)[:2]
    (loss * MASK).sum().backward()
    return loss.detach().numpy(), stats["clip_frac"].numpy(), lp.grad.numpy()


def test_advantages_variants_by_hand():
    s = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    # group-mean / group std (unbiased): group 1 mean .25 std .5; group 2 mean 2, std 2/sqrt(3)
    a = G.compute_advantages(s, 4, "group-mean", "group")
    want = [1.5, -0.5, -0.5, -0.5] + [x / (2 / 3**0.5) for x in (1.0, -1.0, -1.0, 1.0)]
    assert a.tolist() == pytest.approx(want, abs=1e-4)
    assert G.compute_advantages(s, 4, "group-mean", "none").tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 1, -1, -1, 1]
    )
    batch_std = torch.tensor(s.tolist()).std().item()
    assert G.compute_advantages(s, 4, "group-mean", "batch").tolist() == pytest.approx(
        [x / batch_std for x in (0.75, -0.25, -0.25, -0.25, 1, -1, -1, 1)], abs=1e-5
    )
    # rloo: score - mean of the other three
    assert G.compute_advantages(s, 4, "rloo", "none").tolist() == pytest.approx(
        [1, -1 / 3, -1 / 3, -1 / 3, 3 - 5 / 3, 1 - 7 / 3, 1 - 7 / 3, 3 - 5 / 3], abs=1e-5
    )
    assert G.compute_advantages(torch.ones(4), 4, "rloo", "group").eq(0).all()
    equal = G.compute_advantages(torch.tensor([2.0, 2, 2, 2]), 4, "group-mean", "group")
    assert equal.eq(0).all() and not torch.isnan(equal).any()  # identical rewards: zeros, not NaN


def test_loss_aggregation_two_responses_of_different_length():
    # response 1: 1 token with loss 4; response 2: 3 tokens with loss 1 each (T = 3)
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    n_tok, n_seq = mask.sum(), 2
    assert G.aggregate(loss, mask, "token-mean", n_tok, n_seq, 8).item() == pytest.approx((4 + 3) / 4)  # 1.75
    assert G.aggregate(loss, mask, "seq-mean-token-mean", n_tok, n_seq, 8).item() == pytest.approx(
        (4 / 1 + 3 / 3) / 2
    )  # 2.5
    assert G.aggregate(loss, mask, "seq-mean-token-sum-norm", n_tok, n_seq, 8).item() == pytest.approx(
        (4 + 3) / (2 * 8)
    )
    # micro-batch shares add up to the minibatch value
    parts = sum(G.aggregate(loss[i : i + 1], mask[i : i + 1], "seq-mean-token-mean", n_tok, n_seq, 8) for i in range(2))
    assert parts.item() == pytest.approx(2.5)


def test_clip_higher_and_overlong_penalty():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    loss, stats = G.grpo_loss(new, old, torch.ones(1, 1), torch.ones(1, 3), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, -1.1])  # A > 0: ratio capped at 1 + eps_high
    assert stats["clip_frac"].tolist() == [[1.0, 0.0, 0.0]]
    loss, _ = G.grpo_loss(new, old, -torch.ones(1, 1), torch.ones(1, 3), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([1.5, 0.8, 1.1])  # A < 0: ratio floored at 1 - eps_low
    pen = G.overlong_penalty(torch.tensor([10, 12, 14, 16]), 16, 4, 1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert G.overlong_penalty(torch.tensor([16]), 16, 0, 1.0).tolist() == [0.0]


def test_gspo_value_and_gradient_against_numpy():
    import numpy as np

    lo, hi = 3e-4, 4e-4
    loss, clipped, grad = _grad(lambda lp: G.gspo_loss(lp, OLD, ADV, MASK, lo, hi))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy()[:, 0], MASK.numpy()
    for i in range(4):
        n = m[i].sum()
        s = np.exp(np.clip(((lp[i] - old[i]) * m[i]).sum() / max(n, 1), -20, 20))
        unclipped, bounded = -a[i] * s, -a[i] * np.clip(s, 1 - lo, 1 + hi)
        want = max(unclipped, bounded)
        assert loss[i] == pytest.approx(np.full(3, want)), i  # the sequence's loss on each of its tokens
        assert clipped[i].tolist() == [float(bounded > unclipped)] * 3
        # d/d lp_it of n_i * L_i: the unclipped branch's -A s m_it (the clipped branch is constant)
        want_grad = -a[i] * s * m[i] if unclipped >= bounded and n else np.zeros(3)
        assert grad[i] == pytest.approx(want_grad, abs=1e-12), i
    assert np.isfinite(loss).all() and np.isfinite(grad).all()
    assert grad[1].tolist() == [0, 0, 0] and grad[3].tolist() == [0, 0, 0]  # zero advantage; fully masked row


def test_cispo_value_and_gradient_against_numpy():
    import numpy as np

    eps = 4.0
    loss, clipped, grad = _grad(lambda lp: G.cispo_loss(lp, OLD, ADV, MASK, eps))
    lp, old, a = LP.numpy(), OLD.numpy(), ADV.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    w = np.minimum(r, 1 + eps)  # the capped weight, a constant for the gradient
    assert loss == pytest.approx(-w * a * lp)
    assert grad == pytest.approx(-w * a * MASK.numpy())  # REINFORCE weighted: no token's gradient dropped
    assert clipped.tolist() == (r > 1 + eps).astype(float).tolist()
    assert clipped[2, 0] == 1 and grad[2, 0] == pytest.approx(-(1 + eps) * -0.7)  # a huge ratio: capped, kept
    assert np.isfinite(loss).all() and np.isfinite(grad).all() and (grad[1] == 0).all()


def test_sapo_value_and_gradient_against_numpy():
    import numpy as np

    tau_pos, tau_neg = 1.0, 1.05
    loss, clipped, grad = _grad(lambda lp: G.sapo_loss(lp, OLD, ADV, MASK, tau_pos, tau_neg))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy(), MASK.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    tau = np.where(a > 0, tau_pos, tau_neg)
    g = 1 / (1 + np.exp(-tau * (r - 1)))
    assert loss == pytest.approx(-a * 4 / tau * g)
    live = np.abs(lp - old) <= 20  # beyond, the log-ratio is clamped (finite ratios, as verl): no gradient
    assert grad == pytest.approx(-a * 4 * g * (1 - g) * r * m * live, abs=1e-8)  # d/d lp = d/d r * r
    assert clipped.tolist() == (4 * g * (1 - g) < 0.5).astype(float).tolist()
    # on-policy the soft gate is the policy gradient: weight 1 at r = 1
    same = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    G.sapo_loss(same, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), None, 1.0, 1.05)[
        0
    ].sum().backward()
    assert same.grad.item() == pytest.approx(-1.0)
    assert np.isfinite(loss).all() and np.isfinite(grad).all() and (grad[1] == 0).all()


def test_grpo_loss_gradient_against_numpy():
    import numpy as np

    loss, clipped, grad = _grad(lambda lp: G.grpo_loss(lp, OLD, ADV, MASK, 0.2, 0.28))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy(), MASK.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    unclipped, bounded = -a * r, -a * np.clip(r, 0.8, 1.28)
    assert loss == pytest.approx(np.maximum(unclipped, bounded))
    live = np.abs(lp - old) <= 20  # beyond, the log-ratio is clamped (finite ratios, as verl): no gradient
    assert grad == pytest.approx(np.where(unclipped >= bounded, -a * r, 0) * m * live, abs=1e-12)
    assert np.isfinite(grad).all()
