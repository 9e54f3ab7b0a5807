"""Rollouts: batched sampling with the KV cache (transformers' `generate`), masks, and the forward
passes that recompute log-probs and values on the sampled sequences.

Legend: B sequences, P (left-padded) prompt length, T response length, V vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from common.ops import entropy_from_logits, selective_log_softmax


def tokenize_queries(tok, texts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for already-templated prompt texts: (B, P) each."""
    assert tok.padding_side == "left", "generation needs left padding (load_tokenizer sets it)"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


class SeededSampler(LogitsProcessor):
    """Samples each row with its own `torch.Generator`, and records the sampled token's log-prob.

    transformers' sampling draws the whole batch from the global RNG, so a row's response would
    depend on its batch-mates. Instead we run `generate` greedily and let this processor do the
    sampling: it applies temperature, top-k and top-p, draws one token per row from that row's
    generator, and returns logits that are -inf everywhere except the drawn token (so greedy
    picks it). The recorded log-prob is log softmax(logits / temperature), before top-k/top-p:
    the quantity PPO recomputes, so `logprobs` here equal the trainer's at step 0."""

    def __init__(self, seeds: list[int], temperature: float, top_k: int, top_p: float, device):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.logprobs: list[torch.Tensor] = []  # T tensors of (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature  # (B, V)
        logp = torch.log_softmax(logits, dim=-1)
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > self.top_p  # keep the token crossing p
            logits = logits.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        tokens = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        self.logprobs.append(logp.gather(1, tokens[:, None])[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)


@dataclass
class Rollout:
    query_responses: torch.Tensor  # (B, P+T)
    responses: torch.Tensor  # (B, T)
    response_mask: torch.Tensor  # (B, T) 1 for real tokens up to and including EOS / the stop string
    is_eos: torch.Tensor  # (B,) bool: the response ended with EOS
    truncated: torch.Tensor  # (B,) bool: hit max_new_tokens without EOS or stop string
    logprobs: torch.Tensor | None  # (B, T) sampler's log-probs (temperature-scaled), 0 on padding


def response_masks(responses: torch.Tensor, eos_id: int, pad_id: int, stopped_early: torch.Tensor | None = None):
    """Mask of real response tokens: everything up to and including the first EOS.

    responses: (B, T). Returns (mask (B, T) float, is_eos (B,) bool, lengths (B,) long).
    Rows without EOS that `generate` stopped early (a stop string) end before their trailing pads.
    Naive: for each row, `n = responses[i].tolist().index(eos)+1 if eos in row else T`."""
    B, T = responses.shape
    ar = torch.arange(T, device=responses.device).expand(B, T)
    is_eos_tok = responses == eos_id
    is_eos = is_eos_tok.any(1)
    first_eos = torch.where(is_eos, is_eos_tok.int().argmax(1), torch.full_like(is_eos, T, dtype=torch.long))
    lengths = torch.where(is_eos, first_eos + 1, first_eos)
    if stopped_early is not None:  # stop strings: length = index after the last non-pad token
        nonpad = (responses != pad_id).int()
        last_real = T - nonpad.flip(1).argmax(1)
        lengths = torch.where(~is_eos & stopped_early, last_real, lengths)
    return (ar < lengths[:, None]).float(), is_eos, lengths


@contextlib.contextmanager
def own_generation_config(model):
    """Inside the block, every model under `model` has an empty `generation_config`.

    transformers fills each unset field of the config passed to `generate` from the model's own
    `generation_config.json`, so a model that ships `repetition_penalty`, `no_repeat_ngram_size`,
    `bad_words_ids`, `suppress_tokens`, `min_new_tokens`, ... would have its logits changed before
    `SeededSampler` sees them: rollouts would come from a penalised distribution whose log-probs
    differ from the trainer's. Sampling knobs are our flags only. (A peft model generates through
    its base model, hence every submodule that has a generation config.)"""
    saved = [
        (m, m.generation_config)
        for m in model.modules()
        if isinstance(getattr(m, "generation_config", None), GenerationConfig)
    ]
    try:
        for m, _ in saved:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, cfg in saved:
            m.generation_config = cfg


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
) -> Rollout:
    """Sample (seeds given) or decode greedily (seeds=None) one response per query row.

    queries, attention_mask: (B, P) left-padded. Returns a `Rollout`; responses are right-padded to
    the longest in the batch (at most max_new_tokens)."""
    B, P = queries.shape
    sampler = SeededSampler(seeds, temperature, top_k, top_p, queries.device) if seeds is not None else None
    gen_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        stop_strings=stop_strings or None,
    )
    with own_generation_config(model):
        out = model.generate(
            input_ids=queries,
            attention_mask=attention_mask,
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([sampler]) if sampler else None,
            tokenizer=tok if stop_strings else None,
        )
    responses = out[:, P:]  # (B, T)
    T = responses.shape[1]
    stopped_early = None
    if stop_strings:
        stopped_early = torch.full((B,), T < max_new_tokens, device=queries.device) | (
            responses[:, -1] == tok.pad_token_id
        )
    mask, is_eos, lengths = response_masks(responses, tok.eos_token_id, tok.pad_token_id, stopped_early)
    # after a row finishes, generate fills it with pad; make that explicit for rows ended by stop strings
    responses = torch.where(mask.bool(), responses, torch.full_like(responses, tok.pad_token_id))
    logprobs = None
    if sampler is not None:
        logprobs = torch.stack(sampler.logprobs, 1)[:, :T] * mask  # (B, T)
    truncated = (lengths == max_new_tokens) & ~is_eos
    return Rollout(torch.cat([queries, responses], 1), responses, mask, is_eos, truncated, logprobs)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` uses: (B, L) -> (B, L)."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def sequence_attention_mask(query_mask: torch.Tensor, T: int) -> torch.Tensor:
    """Attention mask of query + response: the query's (left padding = 0), then ones. (B, P+T).
    Pads after EOS are attended to by nothing that matters (causal attention; they are masked
    out of every loss), so they keep 1 and positions stay those of generation."""
    return torch.cat([query_mask, query_mask.new_ones(query_mask.shape[0], T)], 1)


def forward_logprobs(
    model,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """Log-probs of the response tokens under `model`, logits divided by the sampling temperature.

    query_responses, attention_mask: (B, P+T). Returns logprobs (B, T) (and entropy (B, T))."""
    T = query_responses.shape[1] - P
    # logits_to_keep: project only the last T+1 positions onto the vocabulary (not the prompt's)
    logits = model(
        input_ids=query_responses,
        attention_mask=attention_mask,
        logits_to_keep=T + 1,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    ).logits
    logits = logits[:, :-1]  # (B, T, V): the logits that predicted each response token
    # the temperature divides inside the helpers, after their float32 cast (bf16 logits / T would round again)
    logprobs = selective_log_softmax(logits, query_responses[:, P:], temperature=temperature)  # (B, T)
    if with_entropy:
        return logprobs, entropy_from_logits(logits, temperature=temperature)
    return logprobs


def forward_values(critic, query_responses: torch.Tensor, attention_mask: torch.Tensor, P: int) -> torch.Tensor:
    """Critic values V(s_t) for each response position t (the state before emitting token t): (B, T)."""
    out = critic(
        input_ids=query_responses,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits[:, P - 1 : -1, 0].float()
