"""Forward passes on sampled sequences: micro-batches (rows packed per prompt), the LM head in chunks from
the hidden states, and the log-prob, reference and value forwards the trainers run.

Legend: B sequences, P (left-padded) prompt length, T response length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch
from torch import nn

from common.core.attention import exact_over_a_cache
from common.core.generation import PromptCache, position_ids_from_mask
from common.core.ops import head_logprobs, logprobs_and_entropy, selective_log_softmax
from common.core.process_groups import sharded_logits, tensor_parallel_active

PACKED_MAX_LEN = 2048


@dataclass
class MicroBatch:
    ids: list[int]  # rows of the batch
    p: int  # prompt positions kept: the last p of the batch's P (its longest prompt)
    t: int  # response positions kept: the first t of the batch's T (its longest response)
    lengths: list[int] | None = (
        None  # each row's response positions through its last real token (packing skips the rest)
    )


def micro_batches(
    ids: list[int], query_mask, response_mask, size: int, max_tokens: int = 0, accelerator=None, group: int = 1
) -> list[MicroBatch]:
    """Split a minibatch's rows into micro-batches for forward/backward.

    max_tokens 0: consecutive chunks of `size` rows, each at the batch's full P and T (padded to the
    batch's longest prompt and response). max_tokens > 0 (--micro-batch-tokens; verl's dynamic batch
    size): rows sorted longest first, each micro-batch filled while rows x (its longest prompt + its
    longest response) <= max_tokens (one row at least), and run at its own lengths: less padding and
    fewer, fuller micro-batches. max_tokens < 0: the same with the budget of `size` rows at the batch's
    full length (size x (P + T)): never more memory than the row split, less padding. The loss is
    unchanged: every aggregation divides by minibatch totals, and cut positions are padding (masked;
    causal attention, so real tokens never saw them). With several processes, every process gets as
    many micro-batches (the largest are split): FSDP2 and ZeRO-3 gather weights in each forward, so
    their forward counts must agree. query_mask: (B, P), response_mask: (B, T).
    group > 1 (GRPO's rows i*G .. i*G+G-1 share a prompt, run once per micro-batch: `forward_logprobs(share_prompts=
    True)`): row chunks keep a group's rows side by side; a packed micro-batch costs its distinct prompts x its
    longest prompt + rows x its longest response (`_pack_shared`)."""
    P, T = query_mask.shape[1], response_mask.shape[1]
    p_len = query_mask.sum(1).long().tolist()
    # a response's length: through its last real token (multi-turn rows hold observation tokens of mask 0 before it)
    last = torch.where(response_mask.any(1), T - response_mask.flip(1).float().argmax(1), 1)
    t_len = last.long().tolist()
    if max_tokens == 0:
        ids = sorted(ids, key=lambda i: i // group)  # a group's rows side by side (a stable sort: 1 keeps the order)
        return [
            MicroBatch(c, P, T, [t_len[i] for i in c]) for c in (ids[k : k + size] for k in range(0, len(ids), size))
        ]
    budget = size * (P + T) if max_tokens < 0 else max_tokens
    if group > 1:
        groups = _pack_shared(ids, p_len, t_len, group, budget)
    else:
        order = sorted(ids, key=lambda i: (p_len[i] + t_len[i], i), reverse=True)
        groups, cur, p, t = [], [], 0, 0
        for i in order:
            p2, t2 = max(p, p_len[i]), max(t, t_len[i])
            if cur and (len(cur) + 1) * (p2 + t2) > budget:
                groups.append(cur)
                cur, p2, t2 = [], p_len[i], t_len[i]
            cur.append(i)
            p, t = p2, t2
        groups.append(cur)
    if accelerator is not None and accelerator.num_processes > 1:
        n = int(accelerator.gather(torch.tensor([len(groups)], device=accelerator.device)).max())
        while len(groups) < n:  # split the micro-batch with the most rows (every rank has as many rows)
            k = max((j for j in range(len(groups)) if len(groups[j]) > 1), key=lambda j: len(groups[j]))
            g = groups.pop(k)
            groups[k:k] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [MicroBatch(g, max(p_len[i] for i in g), max(t_len[i] for i in g), [t_len[i] for i in g]) for g in groups]


def packed_size(lengths_per_prompt: list[list[int]], p: int) -> tuple[int, int]:
    """(sequences, their length) of `packed_by_prompt` on a micro-batch with prompts of length p (left padding) and
    these response lengths per prompt: a prompt's responses follow it, unpadded, in sequences of at most
    PACKED_MAX_LEN positions (one response at least), padded to the longest sequence."""
    seqs = []
    for lengths in lengths_per_prompt:
        n = p
        for t in lengths:
            if n + t > PACKED_MAX_LEN and n > p:
                seqs.append(n)
                n = p
            n += t
        seqs.append(n)
    return len(seqs), max(seqs)


def _pack_shared(ids: list[int], p_len: list[int], t_len: list[int], group: int, budget: int) -> list[list[int]]:
    """Micro-batches (lists of rows) for `packed_by_prompt`: a micro-batch costs the positions it runs packed
    (`packed_size`: its sequences x the longest, a sequence being a prompt and its responses unpadded), at most
    `budget` (one row at least). Greedy: each micro-batch starts with the longest row left, then takes, while it fits,
    whichever adds least above that row's own length (prompt + response): the longest row left, or the longest left
    of a prompt already in (its prompt already runs)."""
    order = sorted(ids, key=lambda i: (p_len[i] + t_len[i], i), reverse=True)
    rank = {i: k for k, i in enumerate(order)}
    left = dict.fromkeys(order)  # rows not placed yet, longest first (an ordered set)
    members: dict[int, list[int]] = {}  # each prompt's rows not placed yet, longest first
    for i in order:
        members.setdefault(i // group, []).append(i)
    out = []
    while left:
        cur, lens, p = [], {}, 0  # lens: each prompt's response lengths in this micro-batch

        def cost(i):  # positions run with row i added
            with_i = {**lens, i // group: [*lens.get(i // group, []), t_len[i]]}
            S, L = packed_size(list(with_i.values()), max(p, p_len[i]))
            return S * L

        while left:
            cands = {next(iter(left))} | {members[g][0] for g in lens if members[g]}
            fits = [i for i in cands if not cur or cost(i) <= budget]
            if not fits:
                break
            i = min(fits, key=lambda i: (cost(i) - p_len[i] - t_len[i], rank[i]))
            cur.append(i)
            lens.setdefault(i // group, []).append(t_len[i])
            p = max(p, p_len[i])
            del left[i]
            members[i // group].remove(i)
        out.append(cur)
    return out


def padding_counts(micros: list[MicroBatch], query_mask, response_mask, group: int = 1) -> tuple[float, float]:
    """(padded positions, real tokens) of running `micros`: the update's padding fraction is 1 - real / padded.
    group > 1 (rows packed per prompt, `packed_by_prompt`): the positions of the packed sequences; a prompt's real
    tokens once per sequence it is in, and its rows' response positions through their last real token."""
    padded = real = 0
    for m in micros:
        if group == 1:
            padded += len(m.ids) * (m.p + m.t)
            real += query_mask[m.ids].sum().item() + response_mask[m.ids].sum().item()
            continue
        lens = {}  # each prompt's response lengths
        for i, t in zip(m.ids, m.lengths or [m.t] * len(m.ids)):
            lens.setdefault(i // group, []).append(t)
        S, L = packed_size(list(lens.values()), m.p)
        padded += S * L
        for g, ts in lens.items():  # a prompt's real tokens once per sequence it is in
            real += packed_size([ts], m.p)[0] * query_mask[g * group].sum().item() + sum(ts)
    return padded, real


def forward_by_micro_batch(
    fn,
    micros: list[MicroBatch],
    query_responses,
    attn,
    P: int,
    T: int,
    prompt_cache: PromptCache | None = None,
    lengths: bool = False,
) -> torch.Tensor:
    """fn(query_responses, attn, p) -> (b, t) run over `micros`, each at its own lengths, assembled
    into (B, T) (0 beyond a micro-batch's t). query_responses, attn: (B, P+T). With a `prompt_cache`,
    fn also gets `prompt_cache=` its micro-batch's part (`PromptCache.select`), for `forward_logprobs`, where
    that gives the full forward's numbers exactly (`common.core.attention.exact_over_a_cache`: up to 192 positions).
    `lengths`: fn also gets `lengths=` its rows' response lengths (`forward_logprobs(share_prompts=True)`)."""
    out = torch.zeros(query_responses.shape[0], T, device=query_responses.device)
    for m in micros:
        cut = slice(P - m.p, P + m.t)
        exact = prompt_cache is not None and exact_over_a_cache(m.p + m.t)  # else the full forward (issue 32.4)
        kw = {"prompt_cache": prompt_cache.select(m.ids, m.p)} if exact else {}
        if lengths:
            kw["lengths"] = m.lengths
        out[m.ids, : m.t] = fn(query_responses[m.ids, cut], attn[m.ids, cut], m.p, **kw).float()
    return out


# The LM head applied in chunks (common.core.ops.head_logprobs) where the model's logits are exactly `lm_head(hidden)`:
# these families' causal LMs (no soft-capping or logit scale), a plain nn.Linear head whose weight is whole here.
# Elsewhere (FSDP, ZeRO-3 or tensor-parallel shards, a LoRA-adapted head, other families) the full logits.
CHUNKED_HEAD_MODELS = {"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "olmo2", "phi3", "smollm3"}
_HEAD_SWAP = threading.Lock()
_LOCAL = threading.local()  # this thread's forwards take the hidden states (another thread's, on the same model, not)


def _causal_lm(model):
    """The transformers causal LM inside DDP's, DeepSpeed's and PEFT's wrappers."""
    while type(model).__name__ in ("DistributedDataParallel", "DeepSpeedEngine"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT


def chunkable_head(model):
    """The LM head (nn.Linear) of `model` (DDP- or PEFT-wrapped) when its log-probs can be taken in chunks from the
    hidden states, else None. CLEANRLHF_LM_HEAD=full turns it off (benchmarks' baseline)."""
    from torch.distributed.tensor import DTensor

    if os.environ.get("CLEANRLHF_LM_HEAD") == "full" or tensor_parallel_active():
        return None
    model = _causal_lm(model)
    head = getattr(model, "lm_head", None)
    if (
        getattr(getattr(model, "config", None), "model_type", None) not in CHUNKED_HEAD_MODELS
        or type(head) is not nn.Linear
    ):
        return None
    if head.bias is not None or isinstance(head.weight, DTensor) or hasattr(head.weight, "ds_id"):  # FSDP2, ZeRO-3
        return None
    hooked = head._forward_hooks or head._forward_pre_hooks or head._forward_hooks_with_kwargs  # they edit its logits
    return None if hooked else head


def _hidden(x: torch.Tensor) -> torch.Tensor:
    """The swapped head's forward: its input, and the dtype the head would have run in (the model's forward may run
    under an autocast the caller is not in: accelerate wraps a prepared model's forward in it)."""
    device = x.device.type
    _LOCAL.dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return x


@contextlib.contextmanager
def head_returns_hidden(head):
    """Inside, `head` returns its input in this thread: the model's `.logits` are the last hidden states (B, L, H),
    and the caller applies the head (`head_logprobs`). Going through the model's own forward keeps DDP's gradient
    hooks and PEFT's adapters; the head's forward is an instance attribute only while some thread is inside."""
    if head is None:
        yield
        return
    with _HEAD_SWAP:
        if "forward" not in head.__dict__:
            head.forward = lambda x, f=type(head).forward: (
                _hidden(x) if getattr(_LOCAL, "hidden", False) else f(head, x)
            )
            head._hidden_users = 0
        head._hidden_users += 1
    _LOCAL.hidden, _LOCAL.dtype = True, None
    try:
        yield
    finally:
        _LOCAL.hidden = False
        with _HEAD_SWAP:
            head._hidden_users -= 1
            if head._hidden_users == 0:
                del head.forward, head._hidden_users


def can_share_prompts(model) -> bool:
    """Whether `forward_logprobs(..., share_prompts=True)` may pack a micro-batch's rows per prompt
    (`packed_by_prompt`): a causal LM of CHUNKED_HEAD_MODELS' families, whose attention takes a custom (B, 1, L, L) mask
    as given and has no sliding window, and not under tensor parallelism (untested there)."""
    inner = _causal_lm(model)
    cfg = getattr(inner, "config", None)
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    return getattr(cfg, "model_type", None) in CHUNKED_HEAD_MODELS and window is None and not tensor_parallel_active()


def packed_by_prompt(
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    lengths: list[int] | None = None,
    max_len: int = PACKED_MAX_LEN,
):
    """The rows of a micro-batch packed per distinct prompt: [prompt, response 1, response 2, ...] in one sequence,
    each response attending to the prompt's real positions and causally to itself, none to another, at the positions
    it has in its own row. One forward then gives every response's log-probs as the rows' forwards do, with each
    prompt computed (and backpropagated) once (TRL #7328's and verl #6401's "prefix sharing").
    query_responses, attention_mask: (B, P+T), left-padded prompts; lengths: each row's response positions to run
    (through its last real token, `MicroBatch.lengths`; default T): a response takes that many positions, unpadded.
    A sequence holds at most max_len positions (one response at least; more go to another sequence of the prompt).
    Returns input ids and position ids (S, L), the attention mask (S, 1, L, L) bool (True: attend; a position with
    nothing to attend to attends to itself), and `index` (B, T): the flat position (in S * L) whose output predicts
    each response token (past a row's length: its prompt's last position, a finite stand-in the loss masks)."""
    B, T = query_responses.shape[0], query_responses.shape[1] - P
    lengths = lengths or [T] * B
    distinct, inverse = torch.unique(
        torch.cat([query_responses[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True
    )  # (U, 2P), (B,)
    seqs = []  # (distinct prompt, its rows in this sequence)
    for u in range(len(distinct)):
        rows, n = [], P
        for r in (inverse == u).nonzero()[:, 0].tolist():
            if rows and n + lengths[r] > max_len:
                seqs.append((u, rows))
                rows, n = [], P
            rows.append(r)
            n += lengths[r]
        seqs.append((u, rows))
    S, L, dev = len(seqs), max(P + sum(lengths[r] for r in rows) for _, rows in seqs), query_responses.device
    ids = torch.zeros(S, L, dtype=torch.long, device=dev)
    pos = torch.zeros(S, L, dtype=torch.long, device=dev)
    seg = torch.full((S, L), -1, device=dev)  # -1 padding, 0 the prompt's real positions, j + 1 response j
    index = torch.empty(B, T, dtype=torch.long, device=dev)
    ar = torch.arange(T, device=dev)
    for s, (u, rows) in enumerate(seqs):
        prompt_mask = distinct[u, P:]
        ids[s, :P], pos[s, :P] = distinct[u, :P], position_ids_from_mask(prompt_mask[None])[0]
        seg[s, :P] = torch.where(prompt_mask == 1, 0, -1)
        a = P  # where the next response starts
        for j, r in enumerate(rows):
            t = lengths[r]
            ids[s, a : a + t], pos[s, a : a + t], seg[s, a : a + t] = (
                query_responses[r, P : P + t],
                prompt_mask.sum() + ar[:t],
                j + 1,
            )
            index[r] = s * L + P - 1  # the prompt's last position predicts the first token (and stands in past t)
            index[r, 1:t] = s * L + a + ar[: t - 1]  # then the row's own positions
            a += t
    i = torch.arange(L, device=dev)
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]  # (S, L, 1), (S, 1, L)
    mask = (i[None, :] <= i[:, None]) & (k_seg != -1) & (q_seg != -1) & ((k_seg == 0) | (k_seg == q_seg))
    return ids, pos, (mask | torch.eye(L, dtype=torch.bool, device=dev))[:, None], index


def rows_as_rollout(ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """Right-padded `prompt + response` rows (`encode_prompt_response`: DPO's chosen and rejected) in the rollout's
    layout, for `forward_logprobs(..., share_prompts=True)`: prompts left-padded to P, responses right-padded to T.
    ids, attention_mask, response_mask: (N, L). Returns query_responses and attention_mask (N, P+T) (padding id 0),
    P, and each row's response length (N,). Rows whose prompts tokenise alike then share them; others simply don't."""
    prompt_len = (attention_mask * (1 - response_mask.long())).sum(1).tolist()  # (N,)
    response_len = (attention_mask * response_mask.long()).sum(1).tolist()  # (N,)
    P, T, N = max(prompt_len), max(response_len), ids.shape[0]
    qr = torch.zeros(N, P + T, dtype=ids.dtype, device=ids.device)
    am = torch.zeros(N, P + T, dtype=attention_mask.dtype, device=ids.device)
    for i, (p, r) in enumerate(zip(prompt_len, response_len)):
        qr[i, P - p : P + r], am[i, P - p : P + r] = ids[i, : p + r], 1
    return qr, am, P, response_len


def forward_logprobs(
    model,
    query_responses: torch.Tensor,
    attention_mask: torch.Tensor,
    P: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    prompt_cache=None,
    share_prompts: bool = False,
    lengths: list[int] | None = None,
):
    """Log-probs of the response tokens under `model`, logits divided by the sampling temperature.

    query_responses, attention_mask: (B, P+T). Returns logprobs (B, T) (and entropy (B, T)).
    The entropy is a detached statistic unless `entropy_grad` (an entropy bonus in the loss): its
    (B, T, V) float32 softmax graph would otherwise be kept, and with a zero coefficient backpropagated.
    prompt_cache: (the prompts' KV cache, their last logits (B, V)) of the same weights (`PromptCache.select`):
    only the response positions run.
    share_prompts (GRPO's groups; the caller checks `can_share_prompts`): the rows packed per distinct prompt
    (`packed_by_prompt`; `lengths`: each row's response positions to run, the rest left out: their log-probs are
    finite stand-ins, for the caller's mask), one forward in which each prompt runs, and is backpropagated, once. The
    same log-probs and gradients as the rows' forward (float32 to ~1e-5 in log-probs, 1e-4 relative in gradients: the
    attention sums over other shapes; tests/*/test_prompt_once.py). The head runs in chunks from the hidden states where
    it can (`chunkable_head`): no (B, T, V) logits."""
    T = query_responses.shape[1] - P
    positions = position_ids_from_mask(attention_mask)
    responses = query_responses[:, P:]  # (B, T)
    head = chunkable_head(model)
    first = None  # logits of the first response token, when they come from the prompt cache: (B, 1, V)
    with sharded_logits(), head_returns_hidden(head):  # --tp-size: each rank keeps its vocabulary block
        if prompt_cache is not None:  # the response positions over the prompts' KV cache
            cache, first = prompt_cache[0], prompt_cache[1][:, None]
            kw = dict(attention_mask=attention_mask, position_ids=positions[:, P:], past_key_values=cache)
            out = model(input_ids=responses, **kw, use_cache=False).logits[:, :-1]  # (B, T-1, V or H)
        elif share_prompts:  # one forward over the rows packed per prompt; each response's outputs gathered
            ids, pos, mask, index = packed_by_prompt(query_responses, attention_mask, P, lengths)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits  # (S, L, V or H)
            out = out.flatten(0, 1)[index]  # (B, T, V or H)
        else:
            # logits_to_keep: project only the last T+1 positions onto the vocabulary (not the prompt's)
            out = model(
                input_ids=query_responses,
                attention_mask=attention_mask,
                logits_to_keep=T + 1,
                position_ids=positions,
                use_cache=False,
            ).logits[:, :-1]  # (B, T, V or H): what predicted each response token
    # the temperature divides inside the helpers, after their float32 cast (bf16 logits / T would round again)
    if head is not None:  # out: hidden states
        index = responses[:, T - out.shape[1] :]
        lp, ent = head_logprobs(out, head.weight, index, temperature, entropy_grad, dtype=_LOCAL.dtype)
        if first is not None:  # the first token's log-prob from the cache's logits
            lp0, ent0 = logprobs_and_entropy(first, responses[:, :1], temperature=temperature)
            lp, ent = torch.cat([lp0, lp], 1), torch.cat([ent0, ent], 1)
        return (lp, ent) if with_entropy else lp  # (B, T) each
    out = torch.cat([first.to(out.dtype), out], 1) if first is not None else out  # (B, T, V)
    with sharded_logits():  # --tp-size: `out` is this rank's vocabulary block; the log-softmax spans the blocks
        if with_entropy:  # both in one pass over the (B, T, V) logits
            return logprobs_and_entropy(out, responses, temperature=temperature, entropy_grad=entropy_grad)
        return selective_log_softmax(out, responses, temperature=temperature)  # (B, T)


def token_logprobs(model, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, i+1] | ids[:, :i+1]) of right-padded sequences (SFT's and DPO's given tokens): (B, L) -> (B, L-1),
    float32. The LM head in chunks from the hidden states where it can (`chunkable_head`): no (B, L, V) logits,
    which at SFT's lengths are most of a step's memory (SmolLM2, 8 rows x 1024 tokens: 1.6 GB in float32)."""
    head = chunkable_head(model)
    with sharded_logits(), head_returns_hidden(head):  # --tp-size: each rank keeps its block of the vocabulary
        out = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, L-1, V or H)
    if head is not None:
        return head_logprobs(out, head.weight, ids[:, 1:], dtype=_LOCAL.dtype)[0]
    with sharded_logits():  # --tp-size: `out` is this rank's vocabulary block; the log-softmax spans the blocks
        return selective_log_softmax(out, ids[:, 1:])


def reference_logprobs_fn(accelerator, ref_policy, policy, temperature: float = 1.0, share_prompts: bool = False):
    """The reference's log-prob function `fn(query_responses, attention_mask, P) -> (B, T)` (as `forward_logprobs`):
    `ref_policy`, a frozen copy that is not prepared, so run inside accelerator.autocast() (--mixed-precision); or,
    when None (LoRA), `policy` with its adapter disabled (the base weights)."""

    def fn(query_responses, attention_mask, P, lengths=None):
        kw = dict(share_prompts=share_prompts, lengths=lengths)
        if ref_policy is not None:
            with accelerator.autocast():
                return forward_logprobs(ref_policy, query_responses, attention_mask, P, temperature, **kw)
        with accelerator.unwrap_model(policy).disable_adapter():
            return forward_logprobs(policy, query_responses, attention_mask, P, temperature, **kw)

    return fn


def forward_values(critic, query_responses: torch.Tensor, attention_mask: torch.Tensor, P: int) -> torch.Tensor:
    """Critic values V(s_t) for each response position t (the state before emitting token t): (B, T)."""
    out = critic(
        input_ids=query_responses,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.logits[:, P - 1 : -1, 0].float()


reference_logprobs = reference_logprobs_fn  # the name before 2026-12 (users' copies of the scripts)
