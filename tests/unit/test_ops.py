"""Every common/core/ops.py helper against an independent computation (numpy or plain loops)."""

import math

import numpy as np
import pytest
import torch

from common.core.ops import (
    entropy_from_logits,
    exact_div,
    gae,
    kl_estimate,
    logprobs_and_entropy,
    masked_mean,
    masked_var,
    masked_whiten,
    rollout_correction,
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


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_over_turns_skips_observation_tokens(gamma, lam):
    """A multi-turn row (common/core/envs.py): model tokens (mask 1) with observation tokens (mask 0) between turns,
    then padding. GAE equals a textbook loop over the model's tokens alone (observations removed), scattered back; the
    observation and padding positions get 0. Rewards and values there are ignored (set to garbage here)."""
    g = torch.Generator().manual_seed(2)
    layouts = [[1, 1, 0, 0, 0, 1, 1, 1, 0], [1, 0, 0, 1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]]
    mask = torch.tensor(layouts, dtype=torch.float)
    r, v = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    r, v = torch.where(mask > 0, r, 1e3), torch.where(mask > 0, v, -1e3)  # garbage where mask 0
    adv, ret = gae(r, v, mask, gamma, lam)
    for i, layout in enumerate(layouts):
        own = [t for t, m in enumerate(layout) if m]
        a, R = naive_gae([r[i, t].item() for t in own], [v[i, t].item() for t in own], len(own), gamma, lam)
        want_a, want_r = np.zeros(9), np.zeros(9)
        want_a[own], want_r[own] = a, R
        np.testing.assert_allclose(adv[i].numpy(), want_a, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(ret[i].numpy(), want_r, rtol=1e-5, atol=1e-4)


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


# ---------------------------------------------------------------------------------------------
# Attention of short sequences in low precision (common.core.attention.small_attention_forward)
# ---------------------------------------------------------------------------------------------
def naive_attention(q, k, v, allowed):
    """float64 loops: head h reads key/value head h // g; allowed[b][i][j] = query i may see key j."""
    B, H, Q, d = q.shape
    g = H // k.shape[1]
    out = np.zeros((B, Q, H, d))
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                if not allowed[b][i].any():  # a fully masked row: compared nowhere
                    continue
                s = np.array([q[b, h, i] @ k[b, h // g, j] / math.sqrt(d) for j in range(k.shape[2])])
                s = np.where(allowed[b][i], s, -np.inf)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ v[b, h // g]
    return out


@pytest.mark.parametrize("case", ["padded", "causal", "decode", "suffix"])
def test_small_attention_matches_plain_loops_under_bf16_autocast(case):
    """Under bf16 autocast (float32 queries/keys, as rotary embeddings give them; bf16 values) the two-matmul
    path equals float64 loops to bf16 rounding of the output, with grouped-query heads (6 query heads, 2 kv
    heads), a padding mask, the implicit causal mask (mask None) with and without a cached prefix, and decoding;
    a fully masked query row (left padding) stays finite. Gradients match the float64 ones too."""
    from types import SimpleNamespace

    from common.core.attention import small_attention_forward

    g = torch.Generator().manual_seed(0)
    Q, K = {"padded": (5, 5), "causal": (5, 5), "decode": (1, 7), "suffix": (2, 6)}[case]
    q = (torch.randn(3, 6, Q, 8, generator=g) * 2).requires_grad_()
    k = (torch.randn(3, 2, K, 8, generator=g) * 2).requires_grad_()
    v = torch.randn(3, 2, K, 8, generator=g).to(torch.bfloat16).requires_grad_()
    allowed = np.tril(np.ones((Q, K), bool), K - Q)[None].repeat(3, 0)  # causal, query = the last Q positions
    mask = None
    if case == "padded":  # row 0 left-padded by 2: its keys 0, 1 are hidden, and its queries 0, 1 see nothing
        allowed[0, :, :2] = False
        mask = torch.from_numpy(allowed[:, None].copy())  # (B, 1, Q, K) bool, transformers' sdpa mask
    module = SimpleNamespace(training=False, num_key_value_groups=3, is_causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = small_attention_forward(module, q, k, v, mask, scaling=None)
    assert out.shape == (3, Q, 6, 8) and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    want = naive_attention(
        q.detach().double().numpy(), k.detach().double().numpy(), v.detach().double().numpy(), allowed
    )
    seen = allowed.any(-1)  # (B, Q): rows with something to attend to
    np.testing.assert_allclose(out.float().detach().numpy()[seen], want[seen], atol=2e-2, rtol=2e-2)
    # gradients of a weighted sum over the rows that see something, against float64 autograd on the same formula
    w = torch.randn(3, Q, 6, 8, generator=g) * torch.from_numpy(seen)[:, :, None, None]
    grads = torch.autograd.grad((out.float() * w).sum(), [q, k, v])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bhid,bhjd->bhij", q64, k64.repeat_interleave(3, 1)) / math.sqrt(8)
    s = s.masked_fill(~torch.from_numpy(allowed)[:, None], -torch.inf)
    o = torch.einsum("bhij,bhjd->bihd", torch.softmax(s, -1).nan_to_num(), v64.repeat_interleave(3, 1))
    want_grads = torch.autograd.grad((o * w.double()).sum(), [q64, k64, v64])
    for got, ref in zip(grads, want_grads):
        assert (got.double() - ref).abs().max() < 3e-2 * ref.abs().max()


def test_small_attention_without_a_mask_is_causal_only_in_a_causal_module():
    """transformers passes attention_mask=None for an unpadded batch of a bidirectional module (an encoder reward
    model); the small path read that as causal (issue 32.3). Against plain bidirectional softmax attention
    computed here: the encoder sees every key; a causal module still masks the future."""
    from types import SimpleNamespace

    import common.core.attention as O

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    scores = (q.double() @ k.double().transpose(-1, -2)) * 8**-0.5  # (1, 2, 5, 5)
    full = scores.softmax(-1) @ v.double()
    causal = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v.double()
    for is_causal, want in ((False, full), (True, causal)):
        module = SimpleNamespace(training=False, num_key_value_groups=1, is_causal=is_causal)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = O.small_attention_forward(module, q, k, v, None)[0].transpose(1, 2).double()  # (1, 2, 5, 8)
        assert (got - want).abs().max() < 2e-2, is_causal
        assert (got - (causal if not is_causal else full)).abs().max() > 5e-2  # the other reading is far off


def test_an_encoder_reward_model_scores_as_with_sdpa(tiny, tmp_path):
    """A RoBERTa-class reward model loaded by load_reward_model in bf16 scores unpadded inputs exactly as with
    transformers' SDPA (before: the small path's causal mask gave other, near-identical scores)."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    from common.core import attention, chat
    from common.core import models as M

    tok = chat.load_tokenizer(tiny)
    cfg = RobertaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        num_labels=1, pad_token_id=tok.pad_token_id, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    RobertaForSequenceClassification(cfg).save_pretrained(tmp_path / "enc")
    tok.save_pretrained(tmp_path / "enc")
    rm = M.load_reward_model(str(tmp_path / "enc"), tok, dtype="bfloat16").eval()
    assert rm.config._attn_implementation == attention.SMALL_ATTENTION
    with torch.no_grad():
        for text in ("hello there my friend", "what a different text"):
            ids = tok(text, return_tensors="pt")
            got = rm(**ids).logits
            rm.set_attn_implementation("sdpa")
            want = rm(**ids).logits
            rm.set_attn_implementation(attention.SMALL_ATTENTION)
            assert torch.equal(got, want), text


def test_small_attention_is_sdpa_in_float32_and_beyond_its_size(monkeypatch):
    """Float32 (no autocast) and score matrices over SMALL_ATTENTION_MAX_SCORES go to transformers' SDPA function
    unchanged: bit-identical outputs (the float32 training path does not change)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import common.core.attention as O

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(2, 4, 6, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
        torch.randn(2, 2, 6, 8, generator=g),
    )
    module = SimpleNamespace(training=False, num_key_value_groups=2, is_causal=True)
    assert torch.equal(
        O.small_attention_forward(module, q, k, v, None)[0], sdpa_attention_forward(module, q, k, v, None)[0]
    )
    monkeypatch.setattr(O, "SMALL_ATTENTION_MAX_SCORES", 35)  # 6 x 6 = 36 scores: too many
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = (
            O.small_attention_forward(module, q, k, v, None)[0],
            sdpa_attention_forward(module, q, k, v, None)[0],
        )
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- sampler-trainer mismatch (issue 32.7)
def _naive_correction(old, mu, mask, cap, level, mode):
    """Per row and token, plain Python floats: the weights and metrics rollout_correction documents."""
    w, k3, mpe, absd, n, acted, rhos = [], 0.0, 0.0, 0.0, 0, 0, []
    for i in range(len(old)):
        ds = [old[i][t] - mu[i][t] for t in range(len(old[i])) if mask[i][t]]
        row = []
        for t in range(len(old[i])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            d = old[i][t] - mu[i][t]
            n, k3, mpe, absd = n + 1, k3 + math.exp(d) - 1 - d, mpe + math.exp(abs(d)), absd + abs(d)
            log_rho = {"token": d, "sequence": sum(ds), "geometric": sum(ds) / len(ds)}[level]
            rho = math.exp(max(-20, min(20, log_rho)))
            rhos.append(rho)
            if mode == "truncate":
                row.append(min(rho, cap))
                acted += rho > cap
            elif mode == "mask":
                row.append(rho if rho <= cap else 0.0)
                acted += rho > cap
            else:
                ok = 1 / cap <= rho <= cap
                row.append(1.0 if ok else 0.0)
                acted += not ok
        w.append(row)
    metrics = {"mismatch/kl": k3 / n, "mismatch/mult_prob_error": mpe / n, "mismatch/ratio_max": max(rhos),
               "train/sampler_logprob_diff": absd / n, "mismatch/capped_frac": acted / n}  # fmt: skip
    return np.array(w), metrics


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "reject"])
def test_rollout_correction_against_a_loop(level, mode):
    """Rows: near agreement, a large gap one way and the other, a fully masked row, and one whose sequence log-ratio
    (30) would overflow without the clamp; every weight finite, padding weight 0."""
    old = [[-1.0, -2.0, -0.5, -3.0], [-0.1, -4.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0], [-1.0, -1.0, -1.0, -1.0],
           [10.0, 10.0, 10.0, 0.0]]  # fmt: skip
    mu = [[-1.01, -1.98, -0.5, -3.2], [-1.5, -1.0, -1.0, -9.0], [-2.0, -2.0, -2.0, -2.0], [-0.2, -3.0, -1.0, -1.0],
          [0.0, 0.0, 0.0, 0.0]]  # fmt: skip
    mask = [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    t = lambda x: torch.tensor(x, dtype=torch.float64)
    weights, metrics = rollout_correction(t(old), t(mu), t(mask), 2.0, level, mode)
    want_w, want_m = _naive_correction(old, mu, mask, 2.0, level, mode)
    assert np.allclose(weights.numpy(), want_w, rtol=1e-9) and torch.isfinite(weights).all()
    assert metrics == pytest.approx(want_m, rel=1e-9)
    assert rollout_correction(t(old), t(mu), t(mask), 0.0, level, mode)[0] is None  # off: no weights, same metrics


def test_rollout_correction_kl_is_the_kl_of_mu_to_pi_old_on_average():
    """mismatch/kl on tokens sampled from mu equals KL(mu || pi_old) computed over a small vocabulary."""
    g = torch.Generator().manual_seed(0)
    log_mu = torch.log_softmax(torch.randn(6, generator=g), 0)
    log_pi = torch.log_softmax(log_mu + 0.6 * torch.randn(6, generator=g), 0)
    tokens = torch.multinomial(log_mu.exp(), 200000, replacement=True, generator=g)[None]  # (1, n) samples of mu
    _, m = rollout_correction(log_pi[tokens].double(), log_mu[tokens].double(), torch.ones(tokens.shape))
    exact = float((log_mu.exp() * (log_mu - log_pi)).sum())
    assert m["mismatch/kl"] == pytest.approx(exact, rel=0.03) and exact > 0.01
