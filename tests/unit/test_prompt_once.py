"""Issue 52's two levers, each against the computation it replaces: the LM head applied in chunks from the hidden
states (common.core.ops.head_logprobs) and a group's prompt run once in the forward and backward
(forward_logprobs(share_prompts=True)): the same values and gradients, on every GRPO loss and aggregation, with
the KL term, multi-turn masks, LoRA, packed micro-batches, and (distributed tier) DDP with 2 processes."""

import math
import os
import sys
import threading

import grpo_llm as G  # noqa: E402
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.core import chat
from common.core import models as M
from common.core.forwards import (
    MicroBatch,
    can_share_prompts,
    chunkable_head,
    forward_logprobs,
    head_returns_hidden,
    micro_batches,
    padding_counts,
)
from common.core.generation import sequence_attention_mask
from common.core.ops import head_logprobs, kl_estimate, logprobs_and_entropy
from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


# ------------------------------------------------------------------- a group's prompt once, with the chunked head
def group_batch(tok, G_=3, T=6, seed=0):
    """Three prompts of different lengths (left padding) x G rows each, random responses whose masks hold a shorter
    response and multi-turn holes (observation tokens: mask 0 between real ones)."""
    from common.core.generation import tokenize_queries

    g = torch.Generator().manual_seed(seed)
    texts = [chat.apply_chat(tok, "x" * k) for k in (3, 11, 6) for _ in range(G_)]
    q, qm = tokenize_queries(tok, texts)
    r = torch.randint(5, len(tok) - 1, (len(texts), T), generator=g)
    mask = torch.ones(len(texts), T)
    mask[1, 4:] = 0  # a short response (its pads stay in the forward, masked out of the loss)
    mask[4, 2:4] = 0  # an observation inside a multi-turn response
    return torch.cat([q, r], 1), sequence_attention_mask(qm, T), qm, mask, q.shape[1]


def loss_and_grads(model, ref, batch, loss_type, loss_agg, micros=None, share=False):
    """GRPO's loss as grpo_llm.py builds it (its loss functions and aggregation) with a KL term to `ref`, over
    `micros` (all rows in one by default); returns (loss, {name: gradient})."""
    qr, am, qm, mask, P = batch
    T = mask.shape[1]
    B = len(qr)
    adv = torch.linspace(-1.0, 1.2, B)[:, None]
    losses = {
        "grpo": lambda *x: G.grpo_loss(*x, eps_low=0.2, eps_high=0.28),
        "gspo": lambda *x: G.gspo_loss(*x, eps_low=3e-4, eps_high=4e-4),
        "cispo": lambda *x: G.cispo_loss(*x, eps_high=0.2),
        "sapo": lambda *x: G.sapo_loss(*x, tau_pos=1.0, tau_neg=1.05),
    }
    model.zero_grad()
    micros = micros or [MicroBatch(list(range(B)), P, T)]
    total = 0.0
    for m in micros:
        ids, cut = m.ids, slice(P - m.p, P + m.t)
        kw = dict(share_prompts=share, lengths=m.lengths if share else None)
        lp, ent = forward_logprobs(model, qr[ids, cut], am[ids, cut], m.p, 0.9, True, **kw)
        with torch.no_grad():
            ref_lp = forward_logprobs(ref, qr[ids, cut], am[ids, cut], m.p, 0.9, **kw)
        old = lp.detach() + 0.1 * torch.sin(torch.arange(m.t, dtype=torch.float32))  # off-policy: clipping acts
        mm = mask[ids, : m.t]
        token_loss, _ = losses[loss_type](lp, old, adv[ids], mm)
        agg = lambda x: G.aggregate(x, mm, loss_agg, mask.sum(), B, T)
        loss = agg(token_loss) + 0.05 * agg(kl_estimate(lp, ref_lp, "k3")) - 0.01 * agg(ent)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, what):
    (la, ga), (lb, gb) = a, b
    assert ga.keys() == gb.keys() and ga, what
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-6), what
    for k in ga:  # every parameter's gradient, relative to its size
        err = (ga[k] - gb[k]).abs().max().item() / max(gb[k].abs().max().item(), 1e-8)
        assert err < 1e-4, (what, k, err)


@pytest.fixture(scope="module")
def policy_and_ref(tiny):
    tok = chat.load_tokenizer(tiny)
    policy = M.load_causal_lm(tiny, tok).float()
    ref = M.load_causal_lm(tiny, tok).float()
    with torch.no_grad():  # a reference that differs from the policy: the KL term has a gradient
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return tok, policy, ref


# ---------------------------------------------------------------------------------------------- the chunked head
@pytest.mark.parametrize("temperature,entropy_grad,chunk", [(1.0, False, 4), (0.7, True, 5), (1.3, True, 64)])
def test_chunked_head_equals_the_formula(temperature, entropy_grad, chunk):
    """Log-probs, entropies and the gradients of hidden states and head weight against numpy's float64 softmax."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 6, 29
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    idx = torch.randint(V, (B, T), generator=g)
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)  # the loss's weights
    lp, ent = head_logprobs(h, w, idx, temperature, entropy_grad, chunk=chunk)
    loss = (a * lp).sum() + ((b * ent).sum() if entropy_grad else 0)
    loss.backward()

    # numpy, float64: z = h w^T / t; logp = z - lse; H = -sum p log p; d/dz of sum a*logp + b*H
    hn, wn, ix, an, bn = (x.detach().double().numpy() for x in (h, w, idx, a, b))
    z = hn @ wn.T / temperature  # (B, T, V)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = np.exp(logp)
    want_lp = np.take_along_axis(logp, ix.astype(int)[..., None], -1)[..., 0]
    want_ent = -(p * logp).sum(-1)
    onehot = np.eye(V)[ix.astype(int)]
    dz = an[..., None] * (onehot - p)
    if entropy_grad:  # dH/dz_j = -p_j (log p_j + H)
        dz += bn[..., None] * (-p * (logp + want_ent[..., None]))
    dz /= temperature
    want_dh, want_dw = dz @ wn, np.einsum("btv,bth->vh", dz, hn)
    np.testing.assert_allclose(lp.detach().numpy(), want_lp, atol=2e-5)
    np.testing.assert_allclose(ent.detach().numpy(), want_ent, atol=2e-5)
    np.testing.assert_allclose(h.grad.numpy(), want_dh, atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(w.grad.numpy(), want_dw, atol=5e-5, rtol=1e-4)
    assert ent.requires_grad == entropy_grad  # a detached statistic unless it is in the loss


def test_chunked_head_under_bf16_autocast_follows_the_full_logits():
    """Under autocast both take bf16 logits from the same bf16 inputs and the softmax in float32: values within
    bf16's rounding of the logits, gradients within 2 % of the full path's (both bf16 matmuls)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    idx = torch.randint(50, (2, 9), generator=g)
    a = torch.randn(2, 9, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = head_logprobs(h, w, idx, 0.9, chunk=4)
        full, _ = logprobs_and_entropy(F.linear(h, w), idx, temperature=0.9)
    assert full.dtype == lp.dtype == torch.float32
    assert (lp - full).abs().max() < 2e-2
    gh, gw = torch.autograd.grad((a * lp).sum(), [h, w])
    fh, fw = torch.autograd.grad((a * full).sum(), [h, w])
    assert (gh - fh).norm() / fh.norm() < 2e-2 and (gw - fw).norm() / fw.norm() < 2e-2


@pytest.mark.parametrize("loss_type", ["grpo", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_shared_prompts_and_chunked_head_give_the_full_forwards_loss_and_gradients(
    policy_and_ref, loss_type, loss_agg, monkeypatch
):
    tok, policy, ref = policy_and_ref
    batch = group_batch(tok)
    assert chunkable_head(policy) is not None and can_share_prompts(policy)
    monkeypatch.setenv("CLEANRLHF_LM_HEAD", "full")
    assert chunkable_head(policy) is None
    full = loss_and_grads(policy, ref, batch, loss_type, loss_agg)  # every row its prompt, the (B, T, V) logits
    shared_full_head = loss_and_grads(policy, ref, batch, loss_type, loss_agg, share=True)
    monkeypatch.delenv("CLEANRLHF_LM_HEAD")
    chunked = loss_and_grads(policy, ref, batch, loss_type, loss_agg)
    both = loss_and_grads(policy, ref, batch, loss_type, loss_agg, share=True)
    assert_same(shared_full_head, full, "shared prompts")
    assert_same(chunked, full, "chunked head")
    assert_same(both, full, "both")


def test_packed_micro_batches_share_prompts_and_give_the_same_gradient(policy_and_ref):
    """micro_batches(group=G): each micro-batch within its budget counted as it runs packed (sequences x (prompt + most
    rows of one prompt x longest response), by hand here), prompts shared where rows of one prompt meet, and the
    summed gradient is the one full forward's."""
    tok, policy, ref = policy_and_ref
    qr, am, qm, mask, P = batch = group_batch(tok)
    T, B, G_ = mask.shape[1], len(qr), 3
    full = loss_and_grads(policy, ref, batch, "grpo", "token-mean")
    p_len = qm.sum(1).tolist()
    t_len = [int(mask[i].nonzero().max()) + 1 for i in range(B)]
    for size, tokens in [(2, 0), (3, -1), (4, 2 * P), (9, -1)]:
        micros = micro_batches(list(range(B)), qm, mask, size, tokens, group=G_)
        assert sorted(i for m in micros for i in m.ids) == list(range(B))
        want_padded = want_real = 0
        for m in micros:
            lens = {}  # each prompt's rows' response lengths: its sequence is the prompt, then them unpadded
            for i in m.ids:
                lens.setdefault(i // G_, []).append(t_len[i])
            assert m.lengths == [t_len[i] for i in m.ids]
            S, L = len(lens), m.p + max(sum(ts) for ts in lens.values())  # (2048 positions hold every group here)
            want_padded += S * L
            want_real += sum(p_len[g * G_] for g in lens) + sum(t_len[i] for i in m.ids)
            if tokens:
                budget = size * (P + T) if tokens < 0 else tokens
                assert S * L <= budget or len(m.ids) == 1, (m, budget)
                assert m.p == max(p_len[i] for i in m.ids) and m.t == max(t_len[i] for i in m.ids)
        assert padding_counts(micros, qm, mask, G_) == (want_padded, want_real)
        if (size, tokens) == (9, -1):  # room for whole groups: the rows of a prompt run together
            assert any(len(m.ids) > len({i // G_ for i in m.ids}) for m in micros)
        assert_same(loss_and_grads(policy, ref, batch, "grpo", "token-mean", micros, share=True), full, (size, tokens))
    # group = 1 packs as before: rows by length, longest first (ties: the later row first)
    rows = micro_batches(list(range(B)), qm, mask, 2, -1)
    order = [i for m in rows for i in m.ids]
    assert order == sorted(range(B), key=lambda i: (p_len[i] + t_len[i], i), reverse=True)


def test_packed_sequences_hold_each_prompt_once_and_split_past_the_length_cap():
    """packed_by_prompt by hand on two prompts (one left-padded) x 2 and 1 responses: ids, positions, the mask and the
    gather index; with a cap of one response per sequence, a prompt with two rows becomes two sequences."""
    from common.core.forwards import packed_by_prompt

    q = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9]])
    qm = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1]])
    r = torch.tensor([[11, 12], [21, 22], [31, 32]])
    ids, pos, mask, index = packed_by_prompt(torch.cat([q, r], 1), sequence_attention_mask(qm, 2), 3)
    assert ids.tolist() == [[0, 5, 6, 11, 12, 21, 22], [7, 8, 9, 31, 32, 0, 0]]
    assert pos[0].tolist()[1:] == [0, 1, 2, 3, 2, 3] and pos[1].tolist()[:5] == [0, 1, 2, 3, 4]
    m = mask[:, 0]
    assert m[0, 5].tolist() == [False, True, True, False, False, True, False]  # response 2 sees the prompt, itself
    assert m[0, 4].tolist() == [False, True, True, True, True, False, False]  # response 1's second token
    assert m[1, 6].tolist() == [False] * 6 + [True] and m[0, 0].tolist()[0]  # padding attends to itself only
    L = 7
    assert index.tolist() == [[2, 3], [2, 5], [L + 2, L + 3]]  # the prompt's last position, then the row's own
    # rows run through their last real token only: the first row's one token, unpadded; past it, a stand-in
    ids, _, _, index = packed_by_prompt(torch.cat([q, r], 1), sequence_attention_mask(qm, 2), 3, [1, 2, 2])
    assert ids[0].tolist() == [0, 5, 6, 11, 21, 22] and index[0].tolist() == [2, 2] and index[1].tolist() == [2, 4]
    ids, _, _, index = packed_by_prompt(torch.cat([q, r], 1), sequence_attention_mask(qm, 2), 3, max_len=5)
    assert ids.shape == (3, 5) and index[1, 0] == 5 + 2  # the second row of the first prompt: a sequence of its own


def test_shared_prompts_with_lora_equal_the_full_forward(tiny, monkeypatch):
    from peft import LoraConfig, get_peft_model

    tok = chat.load_tokenizer(tiny)
    base = M.load_causal_lm(tiny, tok).float()
    torch.manual_seed(0)
    policy = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    assert chunkable_head(policy) is base.lm_head  # found through PEFT's wrapper
    batch = group_batch(tok, seed=1)
    monkeypatch.setenv("CLEANRLHF_LM_HEAD", "full")
    full = loss_and_grads(policy, base, batch, "grpo", "seq-mean-token-mean")
    monkeypatch.delenv("CLEANRLHF_LM_HEAD")
    both = loss_and_grads(policy, base, batch, "grpo", "seq-mean-token-mean", share=True)
    assert all("lora_" in k for k in both[1])  # only the adapter trains
    assert_same(both, full, "LoRA")


def test_where_the_levers_are_off(tiny):
    """The chunked head needs a plain head whose logits are lm_head(hidden), and packing a family whose attention takes
    a custom mask as given and no sliding window: a LoRA-adapted head, another family fall back to the full path."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = chat.load_tokenizer(tiny)
    adapted = get_peft_model(M.load_causal_lm(tiny, tok), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert chunkable_head(adapted) is None
    hooked = M.load_causal_lm(tiny, tok)
    hooked.lm_head.register_forward_hook(lambda module, inputs, logits: logits + 1)  # something edits the logits
    assert chunkable_head(hooked) is None
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, bos_token_id=0, eos_token_id=0)
    ).eval()
    assert chunkable_head(gpt2) is None
    qr = torch.randint(40, (2, 7))
    lp = forward_logprobs(gpt2, qr, torch.ones_like(qr), 4)  # the full logits' path
    want = torch.log_softmax(gpt2(qr).logits[:, 3:-1].float(), -1).gather(-1, qr[:, 4:, None])[..., 0]
    assert torch.allclose(lp, want, atol=1e-6)
    assert not can_share_prompts(gpt2) and can_share_prompts(M.load_causal_lm(tiny, tok))
    windowed = M.load_causal_lm(tiny, tok)
    windowed.config.model_type, windowed.config.sliding_window = "mistral", 16  # a custom mask would drop the window
    assert not can_share_prompts(windowed)


def test_shared_prompts_under_gradient_checkpointing(policy_and_ref, tiny):
    """One forward, no KV cache: packing works with checkpointed layers (the same gradients as the rows' forward)."""
    tok, _, ref = policy_and_ref
    model = M.load_causal_lm(tiny, tok).float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert can_share_prompts(model) and chunkable_head(model) is not None
    batch = group_batch(tok, seed=2)
    plain = loss_and_grads(model, ref, batch, "grpo", "token-mean")
    assert_same(loss_and_grads(model, ref, batch, "grpo", "token-mean", share=True), plain, "checkpointing")


def test_sft_and_dpo_log_probs_take_the_chunked_head(tiny, monkeypatch):
    """token_logprobs (SFT's and DPO's log-probs of given tokens, right padding) with the head in chunks equals the
    full logits' log-softmax, values and gradients, in float32 and under bf16 autocast."""
    from common.core.forwards import token_logprobs
    from common.core.ops import selective_log_softmax

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).float()
    ids = torch.randint(5, 1000, (3, 300), generator=torch.Generator().manual_seed(0))  # > one chunk of positions
    attn = torch.ones_like(ids)
    attn[1, 200:] = 0
    w = torch.rand(3, 299)

    def run(full, bf16):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if full:
                lp = selective_log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:])
            else:
                lp = token_logprobs(model, ids, attn)
        (w * lp).sum().backward()
        return lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    for bf16, tol in ((False, 1e-5), (True, 2e-2)):
        (a, ga), (b, gb) = run(False, bf16), run(True, bf16)
        assert (a - b).abs().max() < tol * 10 and (ga - gb).norm() / gb.norm() < tol, bf16


def test_rows_as_rollout_moves_right_padded_rows_into_the_rollout_layout():
    """By hand: prompt lengths 2 and 3, responses 3 and 1, right-padded rows -> prompts left-padded to P = 3."""
    from common.core.forwards import rows_as_rollout

    ids = torch.tensor([[11, 12, 21, 22, 23, 0], [13, 14, 15, 24, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    response_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.float)
    qr, am, P, lengths = rows_as_rollout(ids, attn, response_mask)
    assert P == 3 and lengths == [3, 1]
    assert qr.tolist() == [[0, 11, 12, 21, 22, 23], [13, 14, 15, 24, 0, 0]]
    assert am.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_pairs_share_their_prompt_with_the_loss_and_gradients_of_the_rows(policy_and_ref, loss_type, monkeypatch):
    """dpo_llm.py's chosen and rejected after one copy of their prompt ([prompt, chosen, rejected]) give the loss, the
    summed and mean log-probs and every gradient of the right-padded rows' forward with the full logits (text pairs
    of different prompt and response lengths, an empty rejected answer, the reference with the same packing)."""
    import dpo_llm as D

    tok, policy, ref = policy_and_ref
    pairs = [
        {"prompt": chat.apply_chat(tok, "What is 2+3?"), "chosen": "5", "rejected": "six or seven"},
        {
            "prompt": chat.apply_chat(tok, "Name a colour, please, any colour."),
            "chosen": "red and blue",
            "rejected": "",
        },
        {"prompt": chat.apply_chat(tok, "Hi"), "chosen": "hello there, friend", "rejected": "no"},
    ]
    batch = D.encode_pairs(tok, pairs, 256, 64, None)
    b = len(pairs)

    def run(share):
        policy.zero_grad()
        sums, means = D.response_logps(policy, *batch, share_prompts=share)
        with torch.no_grad():
            ref_sums, ref_means = D.response_logps(ref, *batch, share_prompts=share)
        x, r = (means, ref_means) if loss_type == "ipo" else (sums, ref_sums)
        loss = D.dpo_loss(x[:b], x[b:], r[:b], r[b:], loss_type, 0.1).mean() - 0.5 * means[:b].mean()  # + RPO
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        return loss.item(), grads, sums.detach(), means.detach()

    monkeypatch.setenv("CLEANRLHF_LM_HEAD", "full")
    l0, g0, s0, m0 = run(False)
    monkeypatch.delenv("CLEANRLHF_LM_HEAD")
    import common.core.forwards as R

    packed, sequences = R.packed_by_prompt, []
    monkeypatch.setattr(R, "packed_by_prompt", lambda *a, **k: sequences.append(packed(*a, **k)[0]) or packed(*a, **k))
    l1, g1, s1, m1 = run(True)
    assert [len(ids) for ids in sequences] == [b, b]  # policy and reference: one sequence per pair
    _, _, P, lengths = R.rows_as_rollout(*batch)
    assert {ids.shape[1] for ids in sequences} == {
        P + max(lengths[i] + lengths[b + i] for i in range(b))
    }  # prompt once
    assert torch.allclose(s1, s0, atol=1e-4) and torch.allclose(m1, m0, atol=1e-5)
    assert_same((l1, g1), (l0, g0), f"dpo {loss_type}")


def test_the_chunked_head_runs_in_the_dtype_of_the_models_autocast(tiny, monkeypatch):
    """accelerate runs a prepared model's forward under autocast (--mixed-precision bf16), while the caller is not in
    one: the head applied after the forward takes the forward's bf16, as the model's own head would have."""
    import common.core.forwards as R

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    # what accelerate's prepare does under --mixed-precision bf16 (its AcceleratorState is a process singleton, so
    # an Accelerator made here would take an earlier test's precision)
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    seen = []
    real = R.head_logprobs
    monkeypatch.setattr(R, "head_logprobs", lambda *a, **kw: seen.append(kw["dtype"]) or real(*a, **kw))
    qr = torch.randint(5, 1000, (2, 9))
    assert not torch.is_autocast_enabled("cpu")
    lp = forward_logprobs(model, qr, torch.ones_like(qr), 4)
    monkeypatch.setenv("CLEANRLHF_LM_HEAD", "full")
    full = forward_logprobs(model, qr, torch.ones_like(qr), 4)
    assert seen == [torch.bfloat16] and (lp - full).abs().max() < 2e-2


def test_the_head_returns_hidden_states_only_in_the_thread_that_asked(tiny):
    """Another thread's forward on the same model (an async generator sharing it) gets logits while one thread is
    inside `head_returns_hidden`; after it, the head is the class's again."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    head, ids = chunkable_head(model), torch.randint(100, (1, 5))
    inside, done, widths = threading.Event(), threading.Event(), {}

    def other():
        inside.wait(10)
        widths["other"] = model(input_ids=ids).logits.shape[-1]
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with torch.no_grad(), head_returns_hidden(head):
        widths["inside"] = model(input_ids=ids).logits.shape[-1]
        inside.set()
        done.wait(10)
    t.join()
    assert widths == {"inside": model.config.hidden_size, "other": len(tok)}
    assert "forward" not in head.__dict__ and model(input_ids=ids).logits.shape[-1] == len(tok)


def test_the_chunked_head_holds_no_full_logits(tiny):
    """What autograd saves for backward: the full path keeps (B, T, V) float32 logits, the chunked head only the
    hidden states (B, T, H) and two floats per position (the weight is a parameter either way)."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).float()
    qr = torch.randint(5, 1000, (4, 30))
    am = torch.ones_like(qr)
    V = len(tok)

    def saved_logit_bytes():
        sizes = []

        def pack(x):
            if x.dim() >= 2 and x.shape[-1] == V and x.numel() > V:
                sizes.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            forward_logprobs(model, qr, am, 10, with_entropy=True)
        return sum(sizes)

    chunked = saved_logit_bytes()
    os.environ["CLEANRLHF_LM_HEAD"] = "full"
    try:
        full = saved_logit_bytes()
    finally:
        del os.environ["CLEANRLHF_LM_HEAD"]
    assert chunked == 0 and full >= 4 * 20 * V * 4, (chunked, full)  # at least one float32 copy of the logits
    assert math.isfinite(full)
