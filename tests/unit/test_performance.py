"""The faster paths of #19 change no result: inverse-CDF sampling draws from the same distribution,
shared prompt encoding and dropping finished rows give the same responses, token-budget micro-batches
the same gradient, bf16 autocast log-probs within a stated tolerance; perf/mfu's arithmetic."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import common.core.generation as R
from common.core import attention, chat
from common.core import models as M
from common.core.forwards import forward_by_micro_batch, forward_logprobs, micro_batches, padding_counts
from common.core.generation import generate, sample_tokens, sequence_attention_mask, tokenize_queries


def _np_filtered_probs(logits, temperature, top_k, top_p):
    """The sampling distribution written out in numpy: softmax(logits / T), top-k, then top-p (keep
    the smallest set of most likely tokens whose mass reaches p), renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, p, 0)
    q /= q.sum()
    if top_p < 1.0:
        order = np.argsort(-q)
        before = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        nucleus = np.zeros_like(keep)
        nucleus[order[before <= top_p]] = True  # the token crossing p is kept
        q = np.where(nucleus, q, 0)
        q /= q.sum()
    return q, np.log(p)


def _tok_with_eos(tok, eos):
    class Tok:  # the tokenizer with another token as EOS, so that rows end at different steps
        eos_token_id, pad_token_id = eos, tok.pad_token_id

    return Tok()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_inverse_cdf_sampling_draws_from_the_distribution(temperature, top_k, top_p):
    torch.manual_seed(0)
    V, n = 12, 40000
    logits = torch.randn(V) * 2
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    tokens, logp = sample_tokens(logits.expand(n, V), u, temperature, top_k, top_p)
    want, np_logp = _np_filtered_probs(logits.numpy(), temperature, top_k, top_p)
    freq = np.bincount(tokens.numpy(), minlength=V) / n
    assert np.all(freq[want == 0] == 0)  # filtered tokens are never drawn
    assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() / n)  # within 4 standard errors
    # the log-prob is mu's, the distribution sampled (renormalised after top-k/top-p), as vLLM's processed_logprobs
    assert np.allclose(logp.numpy(), np.log(want[tokens.numpy()]), atol=1e-5)
    if top_k or top_p < 1:  # and not the full distribution's (the definition before issue 32.5)
        assert not np.allclose(logp.numpy(), np_logp[tokens.numpy()], atol=1e-3)


def test_finished_rows_leave_the_batch_and_repeated_prompts_are_encoded_once(tiny_peaky):
    tok = chat.load_tokenizer(tiny_peaky)
    model = M.load_causal_lm(tiny_peaky, tok).eval()
    texts = [chat.apply_chat(tok, p) for p in ["hi", "what is two plus two, tell me", "ok", "count"]]
    q, qm = tokenize_queries(tok, texts)
    free = generate(model, tok, q, qm, 12)
    eos = free.responses[0, 3].item()  # a token the model emits: rows now finish at different steps
    etok = _tok_with_eos(tok, eos)
    ours = generate(model, etok, q, qm, 12)
    lengths = ours.response_mask.sum(1)
    assert ours.is_eos.any() and len(set(lengths.tolist())) > 1, lengths
    with torch.no_grad():  # transformers' greedy decoding, every row to the end, pads after EOS
        hf = model.generate(
            input_ids=q,
            attention_mask=qm,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )[:, q.shape[1] :]
    assert torch.equal(ours.responses, hf[:, : ours.responses.shape[1]])
    # sampled, with G = 3 copies of each prompt (GRPO): equal to each row decoded alone
    rq, rm = q.repeat_interleave(3, 0), qm.repeat_interleave(3, 0)
    seeds = list(range(100, 112))
    batch = generate(model, etok, rq, rm, 12, 1.0, seeds=seeds)
    for i in (0, 4, 11):
        solo = generate(model, etok, rq[i : i + 1], rm[i : i + 1], 12, 1.0, seeds=seeds[i : i + 1])
        n = int(solo.response_mask.sum())
        assert torch.equal(solo.responses[0, :n], batch.responses[i, :n]) and batch.response_mask[i].sum() == n
        assert torch.allclose(solo.logprobs[0, :n], batch.logprobs[i, :n], atol=1e-4)
    # the shared prompt cache changes nothing: the same rollout with every copy encoded
    orig, R.shared_prompt_cache = R.shared_prompt_cache, lambda *a: None
    try:
        unshared = generate(model, etok, rq, rm, 12, 1.0, seeds=seeds)
    finally:
        R.shared_prompt_cache = orig
    assert torch.equal(unshared.responses, batch.responses)
    assert (unshared.logprobs - batch.logprobs).abs().max() < 1e-4
    # and the sampler's log-probs are the trainer's
    attn = sequence_attention_mask(rm, batch.responses.shape[1])
    with torch.no_grad():
        lp = forward_logprobs(model, batch.query_responses, attn, rq.shape[1]) * batch.response_mask
    assert (lp - batch.logprobs).abs().max() < 1e-4


def test_micro_batches_by_token_budget():
    g = torch.Generator().manual_seed(0)
    B, P, T = 13, 9, 11
    p_len, t_len = torch.randint(1, P + 1, (B,), generator=g), torch.randint(0, T + 1, (B,), generator=g)
    qm = (torch.arange(P)[None] >= P - p_len[:, None]).float()  # left padded
    rm = (torch.arange(T)[None] < t_len[:, None]).float()  # right padded
    ids = list(range(B))
    plain = micro_batches(ids, qm, rm, 4)
    assert [m.ids for m in plain] == [ids[0:4], ids[4:8], ids[8:12], ids[12:13]]
    assert all((m.p, m.t) == (P, T) for m in plain)
    for budget in (1, 25, 60, 400):
        micros = micro_batches(ids, qm, rm, 4, budget)
        assert sorted(i for m in micros for i in m.ids) == ids  # every row once
        for m in micros:
            assert m.p == max(p_len[m.ids]).item() and m.t == max(1, max(t_len[m.ids]).item())
            assert len(m.ids) == 1 or len(m.ids) * (m.p + m.t) <= budget
        padded, real = padding_counts(micros, qm, rm)
        naive_padded = naive_real = 0
        for m in micros:  # naive: count every position and every real token of each micro-batch
            for i in m.ids:
                naive_padded += m.p + m.t
                naive_real += int(p_len[i]) + int(t_len[i])
        assert (padded, real) == (naive_padded, naive_real)
    assert len(micro_batches(ids, qm, rm, 4, 400)) == 1


def test_token_budget_micro_batches_give_the_same_gradient(tiny):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    texts = [chat.apply_chat(tok, "x" * k) for k in (1, 30, 5, 12, 2, 40)]
    q, qm = tokenize_queries(tok, texts)
    ro = generate(model, tok, q, qm, 10, 1.0, seeds=list(range(6)))
    mask = ro.response_mask
    mask[1, 3:] = mask[4, 1:] = 0  # shorter responses: right padding to trim
    P, T = q.shape[1], mask.shape[1]
    attn = sequence_attention_mask(qm, T)
    adv = torch.linspace(-1, 1, 6)[:, None]

    def grads(micros):
        model.zero_grad()
        n = mask.sum()
        for m in micros:
            cut = slice(P - m.p, P + m.t)
            lp = forward_logprobs(model, ro.query_responses[m.ids, cut], attn[m.ids, cut], m.p)
            (-(adv[m.ids] * lp * mask[m.ids, : m.t]).sum() / n).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = grads(micro_batches(list(range(6)), qm, mask, 2))
    packed = micro_batches(list(range(6)), qm, mask, 2, 60)
    assert any(m.p < P or m.t < T for m in packed)  # something was trimmed
    assert torch.allclose(grads(packed), full, rtol=1e-4, atol=1e-7)
    with torch.no_grad():  # the no-grad forwards, assembled back to (B, T)
        fn = lambda qr, am, p: forward_logprobs(model, qr, am, p)
        a = forward_by_micro_batch(fn, micro_batches(list(range(6)), qm, mask, 6), ro.query_responses, attn, P, T)
        b = forward_by_micro_batch(fn, packed, ro.query_responses, attn, P, T)
    assert torch.allclose(a * mask, b * mask, atol=1e-5)


def test_bf16_autocast_log_probs_within_tolerance(tiny):
    """bf16 autocast (--mixed-precision bf16) vs float32 on one batch: mean |d log p| < 0.02 nats on the
    tiny model (SmolLM2-135M measured: mean 0.042, max 0.23; docs/performance.md), and the loss within 2 %."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    q, qm = tokenize_queries(tok, [chat.apply_chat(tok, t) for t in ("hello there", "count to ten please")])
    ro = generate(model, tok, q, qm, 12, 1.0, seeds=[1, 2])
    attn = sequence_attention_mask(qm, ro.responses.shape[1])
    with torch.no_grad():
        lp32 = forward_logprobs(model, ro.query_responses, attn, q.shape[1])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp16 = forward_logprobs(model, ro.query_responses, attn, q.shape[1])
    m = ro.response_mask
    assert lp16.dtype == torch.float32  # log-softmax in float32
    assert ((lp16 - lp32).abs() * m).sum() / m.sum() < 0.02
    loss32, loss16 = (lp32 * m).sum() / m.sum(), (lp16 * m).sum() / m.sum()
    assert abs(loss16 - loss32) < 0.02 * abs(loss32)


def test_mfu_arithmetic(tiny, monkeypatch):
    import common.harness.perf as perf

    model = M.load_causal_lm(tiny, chat.load_tokenizer(tiny))
    monkeypatch.setattr(perf, "matmul_peak_flops", lambda device, dtype: 1e9)
    n = sum(p.numel() for p in model.parameters())
    if model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
        n -= model.get_input_embeddings().weight.numel()
    acc = type("Acc", (), {"mixed_precision": "no", "device": "cpu"})()
    assert perf.mfu(model, 100, 10, 2.0, acc) == pytest.approx((2 * n * 100 + 6 * n * 10) / 2.0 / 1e9)


def test_micro_batch_budget_under_deepspeed():
    from common.core.errors import UserError
    from common.parallel.accelerator import micro_batch_budget

    ds, ddp = (
        type("Acc", (), {"distributed_type": t})() for t in ("DistributedType.DEEPSPEED", "DistributedType.MULTI_CPU")
    )
    assert micro_batch_budget(ddp, -1) == -1 and micro_batch_budget(ddp, 512) == 512
    assert micro_batch_budget(ds, -1) == 0 and micro_batch_budget(ds, 0) == 0  # the default falls back to rows
    with pytest.raises(UserError, match="--micro-batch-tokens"):
        micro_batch_budget(ds, 512)


def test_micro_batch_counts_agree_across_processes_and_default_budget():
    B, P, T = 8, 6, 10
    qm = torch.ones(B, P)
    rm = (torch.arange(T)[None] < torch.tensor([10, 1, 1, 1, 1, 1, 1, 1])[:, None]).float()
    ids = list(range(B))
    # -1: the budget of `size` rows at full length, 4 x 16 = 64: the long row and 3 short ones at full
    # length, then 4 short ones cut to 1 response position (4 x 7 = 28 tokens instead of 64)
    default = micro_batches(ids, qm, rm, 4, -1)
    assert [(len(m.ids), m.p, m.t) for m in default] == [(4, P, T), (4, P, 1)]

    class TwoProcesses:  # another process has 5 micro-batches: this one splits its largest until it has as many
        num_processes, device = 2, "cpu"

        def gather(self, x):
            return torch.cat([x, torch.tensor([5])])

    split = micro_batches(ids, qm, rm, 4, -1, TwoProcesses())
    assert len(split) == 5 and sorted(i for m in split for i in m.ids) == ids
    assert all(m.p == P and m.t == max(int(rm[m.ids].sum(1).max()), 1) for m in split)


def test_auto_mixed_precision(tiny, tmp_path, monkeypatch):
    import common.parallel.accelerator as D

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    big = tmp_path / "big"
    big.mkdir()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny)
    config.hidden_size = 576
    config.save_pretrained(big)
    monkeypatch.setattr(D, "cpu_has_native_bf16", lambda: True)
    assert D.auto_mixed_precision(str(big)) == "bf16"
    assert D.auto_mixed_precision(tiny) is None  # hidden 64: bf16 casts cost more than they save
    assert D.auto_mixed_precision(str(big), "bfloat16") is None  # bf16 weights: nothing to autocast
    assert D.auto_mixed_precision(str(tmp_path / "missing")) is None  # reported later, where the model loads
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert D.auto_mixed_precision(str(big)) is None  # the launch config decides
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    monkeypatch.setattr(D, "cpu_has_native_bf16", lambda: False)
    assert D.auto_mixed_precision(str(big)) is None


def test_bf16_reference_weights_are_bit_identical_under_autocast(tiny):
    """prepare_frozen(..., under_autocast=True) under bf16: Linear weights stored in bf16 give exactly the
    log-probs of float32 weights cast by autocast, with less memory; a tied head and the embedding stay
    float32; without bf16 autocast nothing changes."""
    from common.parallel.sharded import prepare_frozen

    tok = chat.load_tokenizer(tiny)
    q, qm = tokenize_queries(tok, ["a b c", "hello there, a longer prompt"])
    qr = torch.cat([q, torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))], 1)
    attn = sequence_attention_mask(qm, 6)
    # stand-ins for a bf16 and a float32 Accelerator (its state is a process-wide singleton, set by other tests)
    cpu = dict(
        distributed_type="NO", device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", torch.bfloat16)
    )
    acc, fp32 = SimpleNamespace(mixed_precision="bf16", **cpu), SimpleNamespace(mixed_precision="no", **cpu)
    ref = M.load_causal_lm(tiny, tok).eval()
    with torch.no_grad(), acc.autocast():
        want = forward_logprobs(ref, qr, attn, q.shape[1])
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
    before = size(ref)
    tied = ref.get_input_embeddings().weight
    linear = sum(m.weight.numel() for m in ref.modules() if isinstance(m, torch.nn.Linear) and m.weight is not tied)
    ref = prepare_frozen(acc, ref, under_autocast=True)
    with torch.no_grad(), acc.autocast():
        got = forward_logprobs(ref, qr, attn, q.shape[1])
    assert torch.equal(got, want)
    assert size(ref) == before - 2 * linear  # 4 -> 2 bytes per Linear weight (the tiny model has no biases)
    assert ref.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert ref.get_input_embeddings().weight.dtype == torch.float32  # tied head: the residual stream stays fp32
    plain = prepare_frozen(fp32, M.load_causal_lm(tiny, tok), under_autocast=True)
    assert all(p.dtype == torch.float32 for p in plain.parameters())


def test_entropy_is_detached_unless_it_is_in_the_loss(tiny):
    """with_entropy gives the same values either way; only entropy_grad=True keeps the (B, T, V) graph,
    and the log-probs' gradient is the same."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    q, qm = tokenize_queries(tok, ["a b c", "hello"])
    qr = torch.cat([q, torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))], 1)
    attn = sequence_attention_mask(qm, 5)
    lp, ent = forward_logprobs(model, qr, attn, q.shape[1], with_entropy=True)
    lp2, ent2 = forward_logprobs(model, qr, attn, q.shape[1], with_entropy=True, entropy_grad=True)
    assert not ent.requires_grad and ent2.requires_grad
    assert torch.allclose(ent, ent2.detach()) and torch.allclose(lp, lp2)
    (g1,) = torch.autograd.grad(lp.sum(), [model.lm_head.weight])
    (g2,) = torch.autograd.grad((lp2.sum() - 0.0 * ent2.sum()), [model.lm_head.weight])
    assert torch.allclose(g1, g2, atol=1e-7)


def test_fused_adamw_follows_foreach_adamw(tiny):
    """The scripts' fused AdamW (one kernel per step) takes the same steps as the foreach AdamW they used
    before, to float32 rounding: 5 steps of a tiny model, max |diff| of the weights < 1e-6."""
    tok = chat.load_tokenizer(tiny)
    q, qm = tokenize_queries(tok, ["a b c", "hello"])
    qr = torch.cat([q, torch.randint(0, 1000, (2, 5), generator=torch.Generator().manual_seed(0))], 1)
    attn = sequence_attention_mask(qm, 5)
    weights = []
    for fused in (False, True):
        model = M.load_causal_lm(tiny, tok)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=fused, foreach=not fused)
        for _ in range(5):
            forward_logprobs(model, qr, attn, q.shape[1]).sum().backward()
            opt.step()
            opt.zero_grad()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    start = torch.cat([p.flatten() for p in M.load_causal_lm(tiny, tok).parameters()])
    assert (weights[0] - start).abs().max() > 1e-3  # the steps moved the weights
    assert (weights[0] - weights[1]).abs().max() < 1e-6


def test_one_autocast_region_per_rollout_changes_no_sample(tiny):
    """unwrap_for_generation makes the rollout one bf16 autocast region (weights cast once, not per
    decoding step): the samples and their log-probs are exactly those of per-forward autocast."""
    from common.parallel.sharded import unwrap_for_generation

    # a stand-in for a bf16 Accelerator (its state is a process-wide singleton, set by other tests) and a model
    # prepared by it: each forward its own autocast region, as Accelerate wraps it
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    acc = SimpleNamespace(unwrap_model=lambda m: m, autocast=bf16, state=SimpleNamespace())
    tok = chat.load_tokenizer(tiny)
    policy = M.load_causal_lm(tiny, tok)
    policy.forward = bf16()(policy.forward)
    q, qm = tokenize_queries(tok, ["a b c", "hello there", "one two three four"])
    seeds = [11, 12, 13]
    plain = generate(policy, tok, q, qm, 12, 1.0, seeds=seeds)  # a region per forward
    assert not torch.is_autocast_enabled("cpu")
    with unwrap_for_generation(acc, policy) as model:
        assert torch.is_autocast_enabled("cpu")
        one = generate(model, tok, q, qm, 12, 1.0, seeds=seeds)
    assert not torch.is_autocast_enabled("cpu")
    assert torch.equal(one.responses, plain.responses) and torch.equal(one.logprobs, plain.logprobs)


def test_the_engines_weight_fingerprint_sees_a_change_no_version_counter_sees():
    """A fused AdamW step and a `.data` write (DeepSpeed ZeRO-1/2's copy-back) leave the parameters' version counters
    where they were; the vLLM engine decides "changed" from the weights' fingerprint, which moves (issue 32.2)."""
    from common.integrations.vllm_engine import weights_fingerprint

    m = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)
    m(torch.randn(2, 4)).sum().backward()
    before, fp = [p._version for p in m.parameters()], weights_fingerprint(m.state_dict())
    assert torch.equal(weights_fingerprint(m.state_dict()), fp)  # unchanged weights: the same fingerprint
    opt.step()
    assert [p._version for p in m.parameters()] == before  # what version counters miss
    fp2 = weights_fingerprint(m.state_dict())
    assert not torch.equal(fp2, fp)
    m.bias.data[0] += 1e-6
    assert not torch.equal(weights_fingerprint(m.state_dict()), fp2) and [p._version for p in m.parameters()] == before


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("long", [False, True])
def test_pi_old_from_the_rollouts_prompt_cache_equals_a_full_forward(tiny, bf16, long):
    """forward_by_micro_batch with Rollout.prompt_cache (PPO's pi_old: the responses' forward over the prompts'
    KV cache) gives the full forward's log-probs: bit-identical under bf16 autocast, within 2e-5 in float32,
    with row and packed (prompt- and response-trimmed) micro-batches, distinct and repeated (shared-cache) prompts;
    the decoding never wrote into the kept cache; no cache unless asked for. `long`: prompts of ~200 tokens, where
    the full forward's (p+t)^2 scores pass SMALL_ATTENTION_MAX_SCORES and the cached one's t(p+t) do not (issue
    32.4: the two took different kernels, |d log p| ~1e-2 in bf16 before any update)."""
    from common.core.attention import SMALL_ATTENTION_MAX_SCORES

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    assert model.config._attn_implementation == attention.SMALL_ATTENTION
    texts = [chat.apply_chat(tok, "x" * k) for k in (1, 30, 5, 12, 2, 40)]
    if long:
        texts = [chat.apply_chat(tok, " x" * (170 + k)) for k in (1, 30, 5, 12, 2, 20)]
        P = tokenize_queries(tok, texts)[0].shape[1]
        assert (P + 10) ** 2 > SMALL_ATTENTION_MAX_SCORES >= 10 * (P + 10), P
    region = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    for batch in (texts, texts[:3] * 2):  # distinct prompts, then each twice (shared_prompt_cache)
        q, qm = tokenize_queries(tok, batch)
        with region:
            ro = generate(model, tok, q, qm, 10, 1.0, seeds=list(range(6)), keep_prompt_cache=True)
        assert generate(model, tok, q, qm, 2, 1.0, seeds=list(range(6))).prompt_cache is None
        mask, P, T = ro.response_mask, q.shape[1], ro.responses.shape[1]
        attn = sequence_attention_mask(qm, T)
        fn = lambda qr, am, p, **c: forward_logprobs(model, qr, am, p, **c)
        for micros in (micro_batches(list(range(6)), qm, mask, 2), micro_batches(list(range(6)), qm, mask, 2, 60)):
            with torch.no_grad(), region:
                full = forward_by_micro_batch(fn, micros, ro.query_responses, attn, P, T) * mask
                cached = forward_by_micro_batch(fn, micros, ro.query_responses, attn, P, T, ro.prompt_cache) * mask
            if bf16:
                assert torch.equal(cached, full), (cached - full).abs().max()
            else:
                assert (cached - full).abs().max() < 2e-5


def test_models_load_with_the_small_attention_and_save_plain_configs(tiny, tmp_path):
    """Every loader swaps transformers' default SDPA for common.core.attention's SMALL_ATTENTION (SDPA beyond its sizes
    and in float32); a saved checkpoint does not name it, so plain transformers loads it with its own default. Under
    bf16 autocast the log-probs agree with SDPA's to bf16 noise."""
    import json

    from transformers import AutoModelForCausalLM

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    critic, rm = M.load_value_model(tiny, tok), M.load_reward_model(tiny, tok)
    assert {x.config._attn_implementation for x in (model, critic, rm)} == {attention.SMALL_ATTENTION}
    model.save_pretrained(tmp_path)
    assert "cleanrlhf" not in json.dumps(json.load(open(tmp_path / "config.json")))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
    q, qm = tokenize_queries(tok, [chat.apply_chat(tok, t) for t in ("hello there", "count to ten please")])
    ro = generate(model, tok, q, qm, 12, 1.0, seeds=[1, 2])
    attn, m = sequence_attention_mask(qm, ro.responses.shape[1]), ro.response_mask
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ours = forward_logprobs(model, ro.query_responses, attn, q.shape[1])
        model.set_attn_implementation("sdpa")
        sdpa = forward_logprobs(model, ro.query_responses, attn, q.shape[1])
    assert not torch.equal(ours, sdpa)  # another kernel ran
    assert ((ours - sdpa).abs() * m).sum() / m.sum() < 0.01


def test_the_weight_fingerprint_is_computed_in_chunks(monkeypatch):
    """weights_fingerprint's float64 work runs on chunks of 4M elements, never a float64 copy of a whole tensor
    (a 49k x 2k embedding would be 0.8 GB more on the device); its values are the naive sums (float64 rounding)."""
    import numpy as np

    from common.integrations.vllm_engine import weights_fingerprint

    big = torch.randn(3 << 21, generator=torch.Generator().manual_seed(0))  # 6.3M elements: two chunks
    small = torch.randn(7, 3, dtype=torch.bfloat16)
    seen, real = [], torch.Tensor.double
    monkeypatch.setattr(
        torch.Tensor, "double", lambda self, *a, **k: (seen.append(self.numel()), real(self, *a, **k))[1]
    )
    fp = weights_fingerprint({"a.weight": big, "b.weight": small})
    monkeypatch.undo()
    assert max(seen) == 1 << 22 and fp.dtype == torch.float64 and fp.shape == (2, 2)
    for row, t in zip(fp, (big, small)):
        x = t.float().numpy().astype(np.float64)
        assert row.tolist() == pytest.approx([x.sum(), (x * x).sum()], rel=1e-12)
