"""algos/distill_llm.py: each divergence against numpy over the vocabulary, the sampled-token estimator's
expectation, the tokenizer check, and (e2e) resume identity and a learning test."""

import sys

import distill_llm as D  # noqa: E402
import numpy as np
import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _logits(seed, shape=(2, 3, 11)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * 2


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_against_numpy(beta):
    s, t = _logits(0), _logits(1)
    ls, lt = _np_log_softmax(s.numpy()), _np_log_softmax(t.numpy())
    ps, pt = np.exp(ls), np.exp(lt)
    kl = lambda p, q: (p * (np.log(p) - np.log(q))).sum(-1)
    if beta == 0:
        want = kl(pt, ps)
    elif beta == 1:
        want = kl(ps, pt)
    else:
        m = beta * pt + (1 - beta) * ps
        want = beta * kl(pt, m) + (1 - beta) * kl(ps, m)
    got = D.generalized_jsd(s, t, beta).numpy()
    assert got.shape == (2, 3) and np.allclose(got, want, atol=1e-6) and (got >= -1e-7).all()
    assert np.allclose(D.generalized_jsd(t, t, beta).numpy(), 0, atol=1e-6)  # same distributions: 0


@pytest.mark.parametrize("renormalise", [False, True])
def test_topk_forward_kl_against_numpy(renormalise):
    """verl's estimator (the default) sums q_k (log q_k - log p_S(k)) over the teacher's top-k with q its probabilities
    as they are; --topk-renormalise divides q by its top-k mass first. Values against numpy; both are least at
    p_S = q / mass on the top-k (gradient 0 there), and the renormalised gradient is verl's divided by the mass."""
    s, t, k = _logits(2), _logits(3), 4
    ls, lt = _np_log_softmax(s.numpy()), _np_log_softmax(t.numpy())
    want = np.zeros(lt.shape[:2])
    for i in range(lt.shape[0]):
        for j in range(lt.shape[1]):
            top = np.argsort(-lt[i, j])[:k]
            q = np.exp(lt[i, j, top])
            q = q / q.sum() if renormalise else q
            want[i, j] = (q * (np.log(q) - ls[i, j, top])).sum()
    top, idx = torch.log_softmax(t, -1).topk(k, -1)
    got = D.topk_forward_kl(s, top, idx, renormalise).numpy()
    assert np.allclose(got, want, atol=1e-5)
    # the student with the teacher's renormalised top-k and nothing else: the optimum of both
    best = torch.full_like(t, -1e4).scatter(-1, idx, top).requires_grad_()
    value = D.topk_forward_kl(best, top, idx, renormalise)
    (g,) = torch.autograd.grad(value.sum(), best)
    assert g.abs().max() < 1e-6
    mass = top.exp().sum(-1)  # (2, 3) the teacher's top-k mass
    assert torch.allclose(value, torch.zeros_like(value) if renormalise else mass * mass.log(), atol=1e-6)
    # elsewhere: each position's gradient is verl's divided by its top-k mass when renormalised
    z = s.clone().requires_grad_()
    (g0,) = torch.autograd.grad(D.topk_forward_kl(z, top, idx, False).sum(), z)
    (g1,) = torch.autograd.grad(D.topk_forward_kl(z, top, idx, True).sum(), z)
    assert torch.allclose(g1, g0 / mass[..., None], atol=1e-10)


def test_reverse_kl_pg_loss_does_not_depend_on_how_the_batch_is_cut():
    """The baseline is per response (the mean advantage of its earlier tokens, by a loop here): the summed loss and its
    gradient are the same over the whole batch, in micro-batches of 2 and of 1 (the old micro-batch mean was not)."""
    g = torch.Generator().manual_seed(4)
    lp = (-torch.rand(4, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    lt = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 4:], mask[3, 2:] = 0, 0
    want = 0.0
    for i in range(4):  # by hand: A_t = lt - lp, b_t = the mean of A over the row's real tokens before t
        seen = []
        for t in range(6):
            if mask[i, t]:
                a = float(lt[i, t] - lp[i, t].detach())
                b = sum(seen) / len(seen) if seen else 0.0
                want += -(a - b) * float(lp[i, t].detach())
                seen.append(a)
    grads = []
    for size in (4, 2, 1):
        total = sum((D.reverse_kl_pg_loss(lp[j : j + size], lt[j : j + size], mask[j : j + size])[0]
                     * mask[j : j + size]).sum() for j in range(0, 4, size))  # fmt: skip
        assert float(total.detach()) == pytest.approx(want, rel=1e-12), size
        grads.append(torch.autograd.grad(total, lp)[0])
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_off_policy_steps_of_reverse_kl_pg_take_the_exact_reverse_kl():
    """--loss reverse-kl-pg with --lmbda < 1: on the data's responses (tokens not drawn from the student) the sampled-
    token form does not move the student toward the teacher (the audit: V = 5, one position, 200 steps). The
    off-policy step takes the exact reverse KL over the vocabulary: equal to generalized_jsd at beta 1 (numpy), and
    200 steps of gradient descent on one position's logits reach the teacher's distribution."""
    from types import SimpleNamespace

    args = SimpleNamespace(loss="reverse-kl-pg", beta=0.5, topk_renormalise=False)
    teacher = torch.log(torch.tensor([[[0.59, 0.22, 0.08, 0.03, 0.08]]], dtype=torch.float64))  # (1, 1, 5)
    data_token = torch.tensor([[[1]]])  # the reference response's token: not the teacher's mode
    mask = torch.ones(1, 1, dtype=torch.float64)
    t_token = teacher.gather(-1, data_token)[..., 0]
    z = torch.zeros(1, 1, 5, dtype=torch.float64, requires_grad=True)
    value = D.token_divergence(args, False, z, data_token, mask, teacher, t_token, None, None)
    ps = np.full(5, 0.2)
    assert float(value) == pytest.approx(
        float((ps * (np.log(ps) - teacher.numpy()[0, 0])).sum()), rel=1e-6
    )  # float32 inside
    opt = torch.optim.SGD([z], lr=1.0)
    for _ in range(200):
        opt.zero_grad()
        (D.token_divergence(args, False, z, data_token, mask, teacher, t_token, None, None).sum()).backward()
        opt.step()
    student = torch.softmax(z, -1)[0, 0].detach().numpy()
    assert np.allclose(student, teacher.exp()[0, 0].numpy(), atol=0.01), student
    # on the student's own samples the step stays the sampled-token estimator
    on = D.token_divergence(args, True, z, data_token, mask, teacher, t_token, None, None)
    lp = torch.log_softmax(z, -1)[0, 0, 1]
    assert float(on) == pytest.approx(float(-(t_token[0, 0] - lp) * lp), rel=1e-9)


def test_sampled_reverse_kl_estimator_has_the_exact_gradient_in_expectation():
    """Tokens drawn from the student over a 6-token vocabulary: the mean of the estimator's advantage is -KL, and
    its gradient w.r.t. the student's logits is the exact gradient of KL(p_S || p_T) (Monte Carlo, 200k draws)."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_()
    lt = torch.log_softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, 0)
    ls = torch.log_softmax(z, 0)
    n = 200_000
    y = torch.multinomial(ls.detach().exp(), n, replacement=True, generator=g)[None]  # (1, n)
    loss, adv = D.reverse_kl_pg_loss(ls[y], lt[y], torch.ones(1, n, dtype=torch.float64))
    (grad,) = torch.autograd.grad(loss.mean(), z)
    p = ls.detach().exp().numpy()
    kl = float((p * (ls.detach().numpy() - lt.numpy())).sum())
    exact = p * (ls.detach().numpy() - lt.numpy() - kl)  # d KL(softmax(z) || q) / dz
    assert float(-adv.mean()) == pytest.approx(kl, rel=0.02)
    assert np.allclose(grad.numpy(), exact, atol=0.01), (grad.numpy(), exact)


def test_a_teacher_with_another_tokenizer_is_refused(tiny, tmp_path):
    from common.core import chat
    from common.core.errors import UserError

    tok = chat.load_tokenizer(tiny)
    other = chat.load_tokenizer(tiny)
    other.add_tokens(["<an_extra_token>"])
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match="--teacher .*tokenizer differs from the student's .*<an_extra_token>"):
        chat.check_same_tokenizer(tok, str(tmp_path / "other"), "--teacher")
    chat.check_same_tokenizer(tok, tiny, "--teacher")  # the same: passes
