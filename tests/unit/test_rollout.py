"""Rollout: reproducible per-sample sampling, masks after EOS, sampler vs recomputed log-probs."""

import torch

from common.core import chat
from common.core import models as M
from common.core.forwards import forward_logprobs
from common.core.generation import generate, response_masks, sequence_attention_mask, tokenize_queries
from common.core.seeds import mix_seed


def _setup(tiny):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).eval()
    texts = [chat.apply_chat(tok, p) for p in ["hi", "what is two plus two, tell me", "ok"]]
    q, qm = tokenize_queries(tok, texts)
    return tok, model, q, qm


def test_sampling_is_reproducible_per_sample(tiny):
    tok, model, q, qm = _setup(tiny)
    seeds = [mix_seed(1, 5, i) for i in range(3)]
    a = generate(model, tok, q, qm, 12, temperature=0.9, seeds=seeds)
    b = generate(model, tok, q, qm, 12, temperature=0.9, seeds=seeds)
    assert torch.equal(a.responses, b.responses)
    # a response depends on its own seed only, not on its batch-mates
    solo_q, solo_m = tokenize_queries(tok, [tok.decode(q[1][qm[1].bool()])])
    solo = generate(model, tok, solo_q, solo_m, 12, temperature=0.9, seeds=seeds[1:2])
    assert torch.equal(solo.responses[0], a.responses[1, : solo.responses.shape[1]])
    c = generate(model, tok, q, qm, 12, temperature=0.9, seeds=[s + 1 for s in seeds])
    assert not torch.equal(a.responses, c.responses)


def test_sampler_logprobs_equal_recomputed(tiny):
    tok, model, q, qm = _setup(tiny)
    for temp, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 50, 0.9)]:
        ro = generate(model, tok, q, qm, 10, temperature=temp, top_k=top_k, top_p=top_p, seeds=[1, 2, 3])
        attn = sequence_attention_mask(qm, ro.responses.shape[1])
        with torch.no_grad():
            lp = forward_logprobs(model, ro.query_responses, attn, q.shape[1], temp) * ro.response_mask
        if not top_k and top_p == 1:
            assert (lp - ro.logprobs).abs().max() < 1e-4
        else:  # mu, renormalised after top-k / top-p: log mu = log pi - log Z >= log pi (docs/rollout.md)
            assert (ro.logprobs - lp).min() > -1e-4 and (ro.logprobs - lp).max() > 1e-3


def test_top_k_restricts_tokens(tiny):
    tok, model, q, qm = _setup(tiny)
    ro = generate(model, tok, q, qm, 6, temperature=1.0, top_k=1, seeds=[7, 8, 9])
    greedy = generate(model, tok, q, qm, 6)
    assert torch.equal(ro.responses, greedy.responses)  # top-1 sampling is greedy


def test_response_masks_after_eos():
    eos, pad = 2, 0
    resp = torch.tensor([[5, 6, 2, 0, 0], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0], [5, 2, 7, 2, 0]])
    mask, is_eos, lengths = response_masks(resp, eos, pad)
    want = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert mask.tolist() == want
    assert is_eos.tolist() == [True, False, True, True]
    for i, row in enumerate(resp.tolist()):  # naive: index of the first EOS + 1, else T
        n = row.index(eos) + 1 if eos in row else len(row)
        assert lengths[i] == n


def test_generate_masks_and_truncation(tiny):
    tok, model, q, qm = _setup(tiny)
    ro = generate(model, tok, q, qm, 8, temperature=1.0, seeds=[1, 2, 3])
    assert ro.responses.shape == ro.response_mask.shape == ro.logprobs.shape
    assert ro.query_responses.shape[1] == q.shape[1] + ro.responses.shape[1]
    n = ro.response_mask.sum(1)
    for i in range(3):
        assert ro.response_mask[i, : int(n[i])].eq(1).all() and ro.response_mask[i, int(n[i]) :].eq(0).all()
        assert ro.logprobs[i, int(n[i]) :].eq(0).all()
    assert ro.truncated.tolist() == [(int(x) == 8 and not e) for x, e in zip(n, ro.is_eos)]


def test_stop_strings_end_responses(tiny_peaky):
    tok, model, q, qm = _setup(tiny_peaky)
    free = generate(model, tok, q, qm, 10)  # greedy, no stop: find a piece of text the model produces
    text = tok.decode(free.responses[0])
    stop = tok.decode(free.responses[0, 2:4])
    assert stop.strip() and stop not in tok.decode(q[0]) + tok.decode(free.responses[0, :2])
    ro = generate(model, tok, q, qm, 10, stop_strings=[stop])
    n = int(ro.response_mask[0].sum())
    assert n < 10 and stop in tok.decode(ro.responses[0, :n]) and not ro.truncated[0]
    assert ro.responses[0, n:].eq(tok.pad_token_id).all()
    assert text.startswith(tok.decode(ro.responses[0, :n]))


def test_generation_mode_is_restored(tiny):
    from common.parallel.sharded import unwrap_for_generation

    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok, gradient_checkpointing=True)
    assert model.training
    with unwrap_for_generation(None, model) as m:
        assert not m.training  # KV cache usable
    assert model.training


def test_the_decoding_cache_is_written_in_place_not_copied_per_token(tiny, monkeypatch):
    """generate's KV cache (common.core.attention.preallocate_cache): each token's key and value are written into one
    buffer per layer sized for the prompt and every new token (its storage never moves while the batch keeps its
    rows), where DynamicLayer's torch.cat allocated a new, one-longer copy of every layer at every token; the
    responses and log-probs are those of the DynamicCache decoding, bit for bit."""
    from transformers import cache_utils

    from common.core import generation as rollout
    from common.core.attention import preallocate_cache

    tok, model, q, qm = _setup(tiny)
    pointers, lengths = [], []
    real_update = cache_utils.Cache.update

    def watched(self, k, v, layer_idx, *a, **kw):
        out = real_update(self, k, v, layer_idx, *a, **kw)
        if layer_idx == 0 and k.shape[-2] == 1:  # a decoding step (not the prefill)
            pointers.append(self.layers[0].keys.untyped_storage().data_ptr())
            lengths.append(self.layers[0].keys.shape[-2])
        return out

    monkeypatch.setattr(cache_utils.Cache, "update", watched)
    new = generate(model, tok, q, qm, 24, temperature=1.0, seeds=[1, 2, 3])
    assert len(pointers) >= 20 and len(set(pointers)) == 1, len(set(pointers))  # one buffer: never reallocated
    assert lengths == list(range(q.shape[1] + 1, q.shape[1] + 1 + len(lengths)))  # the view grows by one a token
    pointers.clear()
    monkeypatch.setattr(rollout, "preallocate_cache", lambda cache, capacity: None)  # DynamicLayer's torch.cat
    old = generate(model, tok, q, qm, 24, temperature=1.0, seeds=[1, 2, 3])
    assert len(set(pointers)) > 1  # a new tensor at every token (the allocator may hand back a freed block)
    assert torch.equal(new.responses, old.responses) and torch.equal(new.logprobs, old.logprobs)

    # a selection of rows keeps the buffer's room; past it the buffer doubles (amortised: no copy per token)
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4), 0)
    preallocate_cache(cache, 8)
    layer = cache.layers[0]
    layer.batch_select_indices(torch.tensor([0, 2]))
    ref = layer.keys.clone()
    step = [torch.randn(2, 2, 1, 4) for _ in range(6)]
    for k in step:
        layer.update(k, k)
    assert layer.keys.shape == (2, 2, 11, 4) and layer._k.shape[-2] >= 11 and layer.get_seq_length() == 11
    assert torch.equal(layer.keys, torch.cat([ref, *step], -2)) and torch.equal(
        layer.values[:, :, 5:], torch.cat(step, -2)
    )
