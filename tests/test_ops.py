"""Every common/ops.py helper against an independent computation (numpy or plain loops)."""

import math

import numpy as np
import pytest
import torch

from common.ops import (
    entropy_from_logits,
    exact_div,
    gae,
    kl_estimate,
    logprobs_and_entropy,
    masked_mean,
    masked_var,
    masked_whiten,
    selective_log_softmax,
)


def test_selective_log_softmax_matches_naive():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 50, generator=g) * 3
    index = torch.randint(0, 50, (5, 7), generator=g)
    got = selective_log_softmax(logits, index, chunk=2)
    want = np.zeros((5, 7))
    for b in range(5):
        for t in range(7):
            row = logits[b, t].double().numpy()
            want[b, t] = row[index[b, t]] - (np.log(np.exp(row - row.max()).sum()) + row.max())
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    assert got.dtype == torch.float32
    assert torch.allclose(
        selective_log_softmax(logits.bfloat16(), index), selective_log_softmax(logits.bfloat16().float(), index)
    )


def test_entropy_from_logits():
    logits = torch.randn(3, 4, 11)
    p = np.exp(logits.double().numpy())
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(entropy_from_logits(logits, chunk=2).numpy(), -(p * np.log(p)).sum(-1), atol=1e-5)
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 1, 8)), torch.tensor(math.log(8)))


def test_masked_stats_against_numpy():
    x = torch.randn(4, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]]).float()
    sel = x.numpy()[mask.numpy().astype(bool)]
    assert masked_mean(x, mask).item() == pytest.approx(sel.mean(), abs=1e-6)
    assert masked_var(x, mask).item() == pytest.approx(sel.var(ddof=1), abs=1e-5)
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(sel.var(ddof=0), abs=1e-5)
    rows = [x[i, : int(mask[i].sum())].mean().item() for i in range(4)]
    np.testing.assert_allclose(masked_mean(x, mask, dim=1).numpy(), rows, atol=1e-6)
    w = masked_whiten(x, mask)
    np.testing.assert_allclose(w.numpy()[mask.numpy().astype(bool)], (sel - sel.mean()) / sel.std(ddof=1), atol=1e-4)
    w2 = masked_whiten(x, mask, shift_mean=False)
    np.testing.assert_allclose(
        w2.numpy()[mask.numpy().astype(bool)], (sel - sel.mean()) / sel.std(ddof=1) + sel.mean(), atol=1e-4
    )
    assert masked_mean(x, torch.zeros_like(mask), dim=1).eq(0).all()  # empty rows give 0, not NaN


def test_kl_estimators_vector():
    lp, ref = torch.tensor([0.5]), torch.tensor([0.0])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.106531, abs=1e-6)
    assert torch.isfinite(kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")).all()
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(lp, ref, "k4")


def naive_gae(rewards, values, length, gamma, lam):
    adv = [0.0] * len(rewards)
    last = 0.0
    for t in reversed(range(length)):
        next_v = values[t + 1] if t + 1 < length else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v if t < length else 0.0 for t, (a, v) in enumerate(zip(adv, values))]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_against_loop(gamma, lam):
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    lengths = [5, 3, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    adv, ret = gae(r, v, mask, gamma, lam)
    for i, n in enumerate(lengths):
        a, R = naive_gae(r[i].tolist(), v[i].tolist(), n, gamma, lam)
        np.testing.assert_allclose(adv[i].numpy(), a, atol=1e-5)
        np.testing.assert_allclose(ret[i].numpy(), R, atol=1e-5)
        assert adv[i, n:].eq(0).all()


def test_exact_div_message():
    assert exact_div(8, 4, "x") == 2
    with pytest.raises(ValueError, match="--batch-size"):
        exact_div(10, 4, "--batch-size over --mini-batch-size")


def test_logprobs_and_entropy_in_one_pass_match_naive():
    """One pass over the chunks gives numpy's log softmax at the index and -sum p log p (temperature 0.7),
    detached unless entropy_grad, and then with the gradient of the two separate helpers."""
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 3).requires_grad_()
    index = torch.randint(0, 11, (3, 5))
    lp, ent = logprobs_and_entropy(logits, index, chunk=2, temperature=0.7)
    z = logits.detach().double().numpy() / 0.7
    logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    np.testing.assert_allclose(
        lp.detach().numpy(), np.take_along_axis(logp, index.numpy()[..., None], -1)[..., 0], atol=1e-5
    )
    np.testing.assert_allclose(ent.numpy(), -(np.exp(logp) * logp).sum(-1), atol=1e-5)
    assert lp.requires_grad and not ent.requires_grad
    _, ent_g = logprobs_and_entropy(logits, index, chunk=2, temperature=0.7, entropy_grad=True)
    (g,) = torch.autograd.grad(ent_g.sum(), [logits])
    (want,) = torch.autograd.grad(entropy_from_logits(logits, temperature=0.7).sum(), [logits])
    assert torch.allclose(g, want, atol=1e-5)
