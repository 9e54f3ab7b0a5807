"""Generation: batched sampling with the KV cache (our own decoding loop), prompt caches, and the masks of
what was sampled (`generate` -> `Generation`).

Legend: B sequences, P (left-padded) prompt length, T response length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.core.attention import preallocate_cache
from common.core.chat import stop_ids
from common.core.process_groups import tensor_parallel_active


def tokenize_queries(tok, texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for already-templated prompt texts: (B, P) each."""
    assert tok.padding_side == "left", "generation needs left padding (load_tokenizer sets it)"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverse-CDF sampling, and its log-prob.

    logits: (b, V) next-token logits; uniforms: (b,) float64 in [0, 1), the row's own random number
    for this position. Temperature, then top-k and top-p, shape the distribution sampled from; the
    returned log-prob is the sampled token's under that distribution, renormalised after top-k/top-p:
    the behaviour policy mu that importance corrections need, and what vLLM returns
    (logprobs_mode="processed_logprobs"), so both engines mean the same (docs/rollout.md). Without top-k/top-p
    it is log softmax(logits / temperature), the quantity the trainer recomputes. Returns (tokens (b,),
    logprobs (b,)).

    Why not `torch.multinomial` with a per-row `torch.Generator`: it draws V exponential variates per
    row and step (B calls of ~1 ms each on a 49k vocabulary: 10 % of a CPU rollout). Inverse CDF needs
    one number per row and step, drawn up front from the row's seed, and one batched cumsum +
    searchsorted: the same distribution, still a function of the row's own seed only."""
    logits = logits.float() / temperature  # (b, V)
    logp = torch.log_softmax(logits, dim=-1)
    filtered = top_k > 0 or top_p < 1.0
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing p
        logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    if filtered:  # mu: the truncated distribution, renormalised
        logp = torch.log_softmax(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1) if filtered else logp.exp()  # (b, V)
    cdf = probs.double().cumsum(-1)  # (b, V) float64
    u = uniforms[:, None] * cdf[:, -1:]  # (b, 1) in [0, total)
    tokens = torch.searchsorted(cdf, u, right=True).clamp(max=probs.shape[-1] - 1)  # first cdf > u: prob > 0
    return tokens[:, 0], logp.gather(1, tokens)[:, 0]


@dataclass
class Generation:
    query_responses: torch.Tensor  # (B, P+T)
    responses: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T) 1 for real tokens up to and including EOS / the stop string
    is_eos: torch.Tensor  # (B,) bool: the response ended with EOS
    truncated: torch.Tensor  # (B,) bool: hit max_new_tokens without EOS or stop string
    logprobs: torch.Tensor | None  # (B, T) sampler's log-probs (temperature-scaled), 0 on padding
    prompt_cache: PromptCache | None = None  # generate(..., keep_prompt_cache=True): the prompts' KV cache
    row_caches: list | None = None  # generate(..., keep_row_caches=True): a RowCache per row that ended with EOS


@dataclass
class RowCache:
    """One sequence's KV cache after a generate call (`keep_row_caches`): its context and response up to, not
    including, the token that ended it (EOS: never fed to the model). The next turn of a multi-turn rollout
    (common.core.envs.Episodes) passes it back as `past`, so only the ids after it (that EOS, the observation) are
    prefilled, not the prompt and every earlier turn again."""

    layers: list  # [(keys, values)] per layer, each (kv heads, L, head dim)
    mask: torch.Tensor  # (L,) 1 on real positions, 0 on padding (left padding and holes between turns)

    @property
    def n_real(self) -> int:
        return int(self.mask.sum())


@dataclass
class PromptCache:
    """The rollout's KV cache of the prompts (before any response token) and the logits of the last prompt
    position. With it, a forward over the responses alone gives the rollout policy's log-probs of the responses
    as a forward over prompt + response does (`forward_logprobs(..., prompt_cache=...)`): bit-identical under
    bf16 autocast, within 2e-5 in float32 (the attention runs at other shapes; tests/*/test_performance.py), at
    the cost of the response positions only. PPO's pi_old is such a forward: in the benchmark config the
    prompts are ~70 % of the tokens. Memory: SmolLM2, 32 rows x 59 prompt tokens, 0.13 GB until pi_old is done."""

    layers: list  # [(keys, values)] per layer, each (B, kv heads, P, head dim)
    last_logits: torch.Tensor  # (B, V): the logits that predicted each row's first response token

    def select(self, ids: list[int], p: int):
        """(a DynamicCache of rows `ids` and their last p prompt positions, their last logits (b, V))."""
        from transformers import DynamicCache

        idx = torch.as_tensor(ids, device=self.last_logits.device)
        P, cache = self.layers[0][0].shape[2], DynamicCache()
        for i, (k, v) in enumerate(self.layers):  # cut positions are left padding: masked, as in a cut forward
            cache.update(k[idx, :, P - p :], v[idx, :, P - p :], i)
        return cache, self.last_logits[idx]


def response_masks(responses: torch.Tensor, eos_id, pad_id: int, stopped_early: torch.Tensor | None = None):
    """Mask of real response tokens: everything up to and including the first EOS.

    responses: (B, T); eos_id: an id or a list of them (common.core.chat.stop_ids: EOS and the template's end of turn).
    Returns (mask (B, T) float, is_eos (B,) bool, lengths (B,) long).
    Rows without EOS that stopped early (a stop string) end before their trailing pads.
    Naive: for each row, `n = responses[i].tolist().index(eos)+1 if eos in row else T`."""
    B, T = responses.shape
    ar = torch.arange(T, device=responses.device).expand(B, T)
    is_eos_tok = torch.isin(responses, torch.as_tensor(eos_id, device=responses.device))
    is_eos = is_eos_tok.any(1)
    first_eos = torch.where(is_eos, is_eos_tok.int().argmax(1), torch.full_like(is_eos, T, dtype=torch.long))
    lengths = torch.where(is_eos, first_eos + 1, first_eos)
    if stopped_early is not None:  # stop strings: length = index after the last non-pad token
        nonpad = (responses != pad_id).int()
        last_real = T - nonpad.flip(1).argmax(1)
        lengths = torch.where(~is_eos & stopped_early, last_real, lengths)
    return (ar < lengths[:, None]).float(), is_eos, lengths


@torch.no_grad()
def shared_prompt_cache(model, queries: torch.Tensor, attention_mask: torch.Tensor):
    """The KV cache of the prompts, each distinct prompt encoded once, and the last position's logits;
    None when every prompt is distinct. GRPO and online DPO sample G responses per prompt from G
    copies of it: encoding the copies is G-1 wasted prompt forwards (on CPU as costly as a third of
    the decoding). queries, attention_mask: (B, P) left-padded. Returns (cache of batch B, logits (B, V))."""
    B, P = queries.shape
    distinct, inverse = torch.unique(torch.cat([queries, attention_mask], 1), dim=0, return_inverse=True)
    if len(distinct) == B:
        return None
    ids, mask = distinct[:, :P], distinct[:, P:]  # (U, P) each
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True, logits_to_keep=1
    )
    out.past_key_values.batch_select_indices(inverse)  # (U, ...) -> (B, ...): row b gets its prompt's cache
    return out.past_key_values, out.logits[inverse, -1]


@torch.no_grad()
def generate(
    model,
    tok,
    queries: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seeds: list[int] | None = None,
    stop_strings: list[str] | None = None,
    engine=None,
    keep_prompt_cache: bool = False,
    on_finished=None,
    past: list[RowCache] | None = None,
    keep_row_caches: bool = False,
) -> Generation:
    """Sample (seeds given) or decode greedily (seeds=None) one response per query row.

    queries, attention_mask: (B, P) left-padded. Returns a `Generation`; responses are right-padded to
    the longest in the batch (at most max_new_tokens).

    Our own decoding loop over the model's forward with its KV cache, not `model.generate`, for
    three things transformers' loop does not do (measured on 2 CPU cores, SmolLM2-135M, 32 prompts x
    64 tokens: docs/performance.md): per-row seeds (`sample_tokens`), repeated prompts encoded once
    (`shared_prompt_cache`), and rows that finished (EOS or a stop string) leave the batch, so the
    decoding cost follows the real response lengths, not B x the longest. Sampling knobs are our
    arguments only: the model's `generation_config.json` (repetition penalties, suppressed tokens,
    ...) is never applied, so rollouts come from the distribution the trainer recomputes.

    engine: a `common.integrations.vllm_engine.VLLMEngine` (--rollout-engine vllm): `model`'s weights are pushed into
    it if they changed since the last call, and it samples instead (same arguments, same Generation).

    keep_prompt_cache: return the prompts' KV cache in `Generation.prompt_cache` (a `PromptCache`; not with an
    engine, under --tp-size (vocabulary-sharded logits) or with sliding-window cache layers: then None).

    on_finished: called as rows end (EOS or a stop string) with (their row indices, their tokens (n, t), stopped
    (n,) bool), while the others decode (common.core.rewards.ScoreAsTheyFinish scores them meanwhile).

    past: a RowCache per row (a previous call's `row_caches`) whose real positions are the first real ids of the row's
    query: only the rest of the query is prefilled (multi-turn rollouts: the previous turn's EOS and the
    observation). Greedy ids equal a full prefill's and log-probs agree to float rounding (the attention runs at
    other shapes; tests/*/test_tool_learning.py). keep_row_caches: return `row_caches` (a RowCache for each row that
    ended with EOS, else None; None in all rows under --tp-size or with sliding-window cache layers)."""
    if engine is not None:  # vLLM runs its model at its own dtype: never inside the trainer's autocast region
        with torch.autocast(queries.device.type, enabled=False):
            engine.sync(model)
            return engine.generate(
                queries, attention_mask, max_new_tokens, temperature, top_k, top_p, seeds, stop_strings
            )
    from transformers import StopStringCriteria

    B, P = queries.shape
    device = queries.device
    uniforms = None  # (B, max_new_tokens) float64: row b's numbers from seeds[b] alone
    if seeds is not None:
        uniforms = torch.stack(
            [torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
        ).to(device)
    stop = StopStringCriteria(tokenizer=tok, stop_strings=stop_strings) if stop_strings else None
    ends = torch.tensor(stop_ids(tok), device=device)  # EOS, the template's end of turn, generation_config's EOS list
    responses = torch.full((B, max_new_tokens), tok.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(B, max_new_tokens, device=device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device)  # ended by a stop string
    shared = shared_prompt_cache(model, queries, attention_mask) if past is None else None
    pos = None
    if past is not None:  # prefill only what follows each row's cache
        cache, attention_mask, pos, logits = _prefill_after(model, tok, queries, attention_mask, past)
    elif shared is not None:
        cache, logits = shared
    else:
        out = model(
            input_ids=queries,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=True,
            logits_to_keep=1,
        )
        cache, logits = out.past_key_values, out.logits[:, -1]  # (B, V)
    prompt_cache = None
    plain = all(type(c).__name__ == "DynamicLayer" for c in cache.layers)  # no sliding-window layers
    if keep_prompt_cache and plain and not tensor_parallel_active():
        # the decoding below copies these tensors into its own buffers (preallocate_cache) and never writes into them
        prompt_cache = PromptCache([(c.keys, c.values) for c in cache.layers], logits)
    preallocate_cache(cache, attention_mask.shape[1] + max_new_tokens)  # each token written in place, not torch.cat
    rows = torch.arange(B, device=device)  # the rows of the batch still in the decoding batch
    mask = attention_mask  # (b, P+t) what the cache holds
    pos = position_ids_from_mask(attention_mask)[:, -1:] if pos is None else pos  # (b, 1)
    done = torch.zeros(B, dtype=torch.bool, device=device)  # finished rows not yet dropped from the batch
    keep_rows = keep_row_caches and plain and not tensor_parallel_active()
    row_caches, valid = [None] * B, {}  # valid: cache positions of a row when it ended with EOS (EOS not fed)
    T = 0
    for t in range(max_new_tokens):
        if uniforms is not None:
            tokens, lp = sample_tokens(logits, uniforms[rows, t], temperature, top_k, top_p)
            logprobs[rows[~done], t] = lp[~done]
        else:
            tokens = logits.argmax(-1)
        tokens = tokens.masked_fill(done, tok.pad_token_id)  # (b,)
        responses[rows[~done], t] = tokens[~done]
        T = t + 1
        ended = ~done & torch.isin(tokens, ends)
        if keep_rows:
            valid.update({int(r): mask.shape[1] for r in rows[ended]})
        if stop is not None:
            hit = ~done & ~ended & stop(torch.cat([queries[rows], responses[rows, :T]], 1), None).to(device)
            stopped[rows[hit]] = True
            ended = ended | hit
        done = done | ended
        if on_finished is not None and ended.any():
            finished = rows[ended]
            on_finished(finished.tolist(), responses[finished, :T], stopped[finished])
        if done.all() or T == max_new_tokens:
            break
        if done.sum() * 8 >= len(rows):  # drop finished rows (copying the cache costs about one decoding step)
            keep = (~done).nonzero()[:, 0]
            if keep_rows:
                _save_row_caches(cache, mask, rows, done.nonzero()[:, 0], valid, row_caches)
            cache.batch_select_indices(keep)
            rows, mask, pos, tokens, done = rows[keep], mask[keep], pos[keep], tokens[keep], done[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
        pos = pos + 1
        logits = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
        ).logits[:, -1]
    if keep_rows:
        _save_row_caches(cache, mask, rows, torch.arange(len(rows), device=device), valid, row_caches)
    responses = responses[:, :T]
    mask, is_eos, lengths = response_masks(responses, ends, tok.pad_token_id, stopped)
    truncated = (lengths == max_new_tokens) & ~is_eos & ~stopped
    logprobs = logprobs[:, :T] * mask if uniforms is not None else None
    return Generation(torch.cat([queries, responses], 1), responses, mask, is_eos, truncated, logprobs, prompt_cache,
                   row_caches if keep_rows else None)  # fmt: skip


def _save_row_caches(cache, mask, rows, idx, valid: dict, out: list) -> None:
    """RowCaches of the decoding batch's rows `idx` that ended with EOS (their first `valid` positions: what was
    fed before EOS; a finished row kept in the batch was fed padding after it), cloned out of the batch's cache."""
    for b in idx.tolist():
        r = int(rows[b])
        if r not in valid or out[r] is not None:
            continue
        n = valid[r]
        first = int(mask[b, :n].argmax())  # drop the left padding: masked, it changes nothing it is cut from
        layers = [(c.keys[b, :, first:n].clone(), c.values[b, :, first:n].clone()) for c in cache.layers]
        out[r] = RowCache(layers, mask[b, first:n].clone())


def _prefill_after(model, tok, queries, attention_mask, past: list[RowCache]):
    """The batch's cache from each row's RowCache (left-padded to the longest, masked) plus a forward over the rest of
    each row's query (its real ids after the cached ones; left-padded). Returns (cache, attention mask (b, L+S),
    positions of the last query token (b, 1), logits of it (b, V)).
    Naive: the forward over the whole query, as without `past`."""
    from transformers import DynamicCache

    device = queries.device
    rest = [q[m.bool()][p.n_real :] for q, m, p in zip(queries, attention_mask, past)]  # each row's new ids
    if min(len(r) for r in rest) == 0:
        raise ValueError("generate(past=...): a row's query holds no id after its cache")
    L, S = max(len(p.mask) for p in past), max(len(r) for r in rest)
    cache = DynamicCache()
    for layer in range(len(past[0].layers)):
        ks, vs = [], []
        for p in past:
            k, v = p.layers[layer]  # (h, l, d)
            ks.append(F.pad(k, (0, 0, L - k.shape[1], 0)))
            vs.append(F.pad(v, (0, 0, L - v.shape[1], 0)))
        cache.update(torch.stack(ks), torch.stack(vs), layer)  # (b, h, L, d)
    ids = torch.full((len(past), S), tok.pad_token_id, dtype=torch.long, device=device)  # (b, S) left-padded
    mask = torch.zeros(len(past), L + S, dtype=torch.long, device=device)  # (b, L+S)
    pos = torch.ones(len(past), S, dtype=torch.long, device=device)  # (b, S) positions continue the row's own
    for b, (p, r) in enumerate(zip(past, rest)):
        ids[b, S - len(r) :] = r
        mask[b, L - len(p.mask) : L] = p.mask.to(device)
        mask[b, L + S - len(r) :] = 1
        pos[b, S - len(r) :] = torch.arange(p.n_real, p.n_real + len(r), device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)  # fmt: skip
    return out.past_key_values, mask, pos[:, -1:], out.logits[:, -1]


# a packed sequence holds a prompt and at most as many of its responses as fit in this many positions: its attention
# runs over all of them (masked), so past a few thousand positions separate rows cost less than the shared prompt saves


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` uses: (B, L) -> (B, L)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def sequence_attention_mask(query_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Attention mask of query + response: the query's (left padding = 0), then ones. (B, P+T).
    Pads after EOS are attended to by nothing that matters (causal attention; they are masked
    out of every loss), so they keep 1 and positions stay those of generation."""
    return torch.cat([query_mask, query_mask.new_ones(query_mask.shape[0], T)], 1)
