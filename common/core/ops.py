"""Pure functions on tensors that every algorithm needs and that are easy to get subtly wrong.

Shapes: B sequences, T response tokens, V vocabulary. `mask` is 1 for real response tokens
(up to and including EOS) and 0 for padding. Each function's docstring gives its naive equivalent;
tests/unit/test_ops.py checks each against plain loops or numpy.

Never here: losses, training loops, the choice of advantages. Those are the algorithm.
"""

from __future__ import annotations

import torch

from common.core.errors import UserError
from common.core.process_groups import STATE


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# ---------------------------------------------------------------------------------------------
def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, chunk: int = 4, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[..., index], without a float32 copy of the whole (B, T, V) tensor.

    logits: (B, T, V) any float dtype; index: (B, T) token ids -> (B, T) float32. The temperature
    divides after the float32 cast (dividing bf16 logits first rounds them a second time).
    Naive equivalent: `torch.log_softmax(logits.float() / t, -1).gather(-1, index[..., None])[..., 0]`.
    We loop over `chunk` rows of the batch at a time (a (chunk, T, V) float32 temporary), since
    for V = 49k and T = 1k the full tensor is 200 MB per sequence."""
    if STATE.logits_sharded:
        return logprobs_and_entropy(logits, index, chunk, temperature)[0]
    out = []
    for lg, ix in zip(logits.split(chunk), index.split(chunk)):
        lg = lg.float() / temperature if temperature != 1.0 else lg.float()
        picked = lg.gather(-1, ix.unsqueeze(-1)).squeeze(-1)  # (b, T)
        out.append(picked - torch.logsumexp(lg, dim=-1))
    return torch.cat(out)


def logprobs_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, chunk: int = 4, temperature: float = 1.0, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`selective_log_softmax` and the entropy of softmax(logits / temperature) in one pass over the chunks:
    (B, T, V), (B, T) -> (B, T), (B, T) float32. The entropy reuses the log-partition of the log-probs,
    H = logsumexp(z) - sum(softmax(z) * z), instead of a second float32 log_softmax over V (what calling
    both helpers costs). It is a detached statistic unless `entropy_grad` (an entropy bonus in the loss).
    Naive: `selective_log_softmax(logits, index, temperature=t), entropy_from_logits(logits, temperature=t)`."""
    logps, ents = [], []
    for lg, ix in zip(logits.split(chunk), index.split(chunk)):
        lg = lg.float() / temperature if temperature != 1.0 else lg.float()  # (b, T, V)
        if STATE.logits_sharded:  # lg is this rank's vocabulary block (b, T, V / tp): see sharded_logits
            lp, ent = _VocabParallelLogProbs.apply(lg, ix, STATE.tp_group, entropy_grad)
            logps.append(lp), ents.append(ent if entropy_grad else ent.detach())
            continue
        lse = torch.logsumexp(lg, dim=-1)  # (b, T)
        logps.append(lg.gather(-1, ix.unsqueeze(-1)).squeeze(-1) - lse)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            z, lse_ = (lg, lse) if entropy_grad else (lg.detach(), lse.detach())
            ents.append(lse_ - (torch.exp(z - lse_.unsqueeze(-1)) * z).sum(-1))
    return torch.cat(logps), torch.cat(ents)


# Under --tp-size the LM head is column-parallel: each rank of a TP group computes the logits of its block
# of the vocabulary. transformers' plan gathers them (every rank then holds the full (B, T, V)); inside
# `sharded_logits()` the head leaves them sharded (common.core.models) and the two functions above compute the
# log-softmax across the blocks (Megatron's vocab-parallel cross-entropy): (B, T, V / tp) per rank.
class _VocabParallelLogProbs(torch.autograd.Function):
    """log softmax(z)[index] and the entropy of softmax(z), z split over the ranks of `group` along the
    vocabulary in equal contiguous blocks (rank r holds ids r*Vl .. (r+1)*Vl-1, DTensor's Shard(-1)).
    Forward: four all-reduces of (b, T) tensors (max, sum of exp, the picked logit, sum p*z), never a
    (b, T, V) one. Backward is local: d logp / dz = onehot - p, d H / dz = -p (z - E_p[z]); the gradient
    of the hidden state is all-reduced by the head (common.core.models). z: (b, T, Vl) float32; index: (b, T)."""

    @staticmethod
    def forward(ctx, z, index, group, entropy_grad):
        import torch.distributed as dist

        Vl = z.shape[-1]
        local = index - dist.get_rank(group) * Vl
        inside = (local >= 0) & (local < Vl)
        local = local.clamp(0, Vl - 1)
        m = z.amax(-1)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m.unsqueeze(-1))  # (b, T, Vl)
        sums = torch.stack([e.sum(-1), (e * z).sum(-1), z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside])
        dist.all_reduce(sums, group=group)  # one all-reduce for the three (b, T) sums
        lse = m + sums[0].log()
        ez = sums[1] / sums[0]  # E_p[z]
        ctx.save_for_backward(z, lse, ez, local, inside)
        ctx.set_materialize_grads(False)  # a detached entropy's gradient stays None (no wasted (b, T, Vl) work)
        return sums[2] - lse, lse - ez

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        z, lse, ez, local, inside = ctx.saved_tensors
        p = torch.exp(z - lse.unsqueeze(-1))
        grad = torch.zeros_like(z)
        if g_logp is not None:
            grad -= p * g_logp.unsqueeze(-1)
            grad.scatter_add_(-1, local.unsqueeze(-1), (g_logp * inside).unsqueeze(-1))
        if g_ent is not None:
            grad -= g_ent.unsqueeze(-1) * p * (z - ez.unsqueeze(-1))
        return grad, None, None, None


def head_chunk(vocab: int, device: torch.device) -> int:
    """Positions per chunk of `head_logprobs`: (chunk, V) float32 temporaries of a budget that depends on the device.
    CPU: 32 MB (they stay in cache; measured fastest on 2 cores). GPU: 1/64 of its memory, at most 2 GiB (an 80 GB
    H100: 1.25 GB, ~2,050 positions at Qwen's 151,936 vocabulary, where 32 MB gave 55 and re-read the (V, H)
    weight for each of them, forward and backward)."""
    budget = 2**25
    if torch.device(device).type == "cuda":
        budget = min(2**31, torch.cuda.get_device_properties(device).total_memory // 64)
    return max(1, budget // (4 * vocab))


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = False,
    chunk: int = 0,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logprobs_and_entropy` of the logits `hidden @ weight.T` without ever holding them: the LM head applied
    a chunk of positions at a time, and recomputed in backward (Liger's fused linear cross-entropy's idea).
    hidden: (B, T, H) the last hidden states (after the final norm); weight: (V, H) the head's; index: (B, T)
    -> log-probs (B, T), entropy (B, T), float32. Under autocast the projection runs in its dtype and the
    softmax in float32, as `model(...).logits` then `logprobs_and_entropy` do. The entropy is a detached
    statistic unless `entropy_grad`. Memory: (chunk, V) float32 temporaries instead of the (B, T, V) logits
    and their float32 copies that autograd keeps (SmolLM2, 32 rows x 64 tokens: 0.4 GB per forward).
    dtype: the projection's compute dtype where the model's forward ran under an autocast this call is not in.
    Naive: `logprobs_and_entropy(hidden @ weight.T, index, temperature=t)`."""
    B, T, H = hidden.shape
    device = hidden.device.type
    if dtype is None:  # the projection's dtype: autocast's here (or the one `dtype` names), else the weight's
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    chunk = chunk or head_chunk(weight.shape[0], hidden.device)
    with torch.autocast(device, enabled=False):
        lp, ent = _ChunkedHead.apply(hidden.reshape(B * T, H), weight, index.reshape(-1), temperature, chunk, dtype)
    return lp.view(B, T), (ent if entropy_grad else ent.detach()).view(B, T)


class _ChunkedHead(torch.autograd.Function):
    """log softmax(z)[index] and the entropy of softmax(z), z = (h @ w.T) / temperature, per chunk of positions.
    Backward recomputes each chunk's z: d logp / dz = onehot - p, d H / dz = -p (z - E_p[z]) (as
    `_VocabParallelLogProbs`); then dh = dz @ w, dw = dz.T @ h, the matmuls in `dtype` as autograd runs the
    head's under autocast. h: (N, H), w: (V, H), index: (N,). Saves h, w, and two floats per position."""

    @staticmethod
    def logits(h, w, temperature, dtype):  # (n, V) float32, as `logits.float() / temperature` of the model's
        z = (h.to(dtype) @ w.T).float()
        return z / temperature if temperature != 1.0 else z

    @staticmethod
    def forward(ctx, h, w, index, temperature, chunk, dtype):
        wd = w.to(dtype)
        out = torch.empty(4, h.shape[0], device=h.device)  # log-prob, entropy, log-partition, E_p[z]
        for s in range(0, h.shape[0], chunk):
            z = _ChunkedHead.logits(h[s : s + chunk], wd, temperature, dtype)  # (n, V)
            lse = torch.logsumexp(z, -1)
            picked = z.gather(-1, index[s : s + chunk, None])[:, 0]
            ez = torch.exp(z - lse[:, None]).mul_(z).sum(-1)  # E_p[z]: in place, one (n, V) temporary
            out[:, s : s + chunk] = torch.stack([picked - lse, lse - ez, lse, ez])
        ctx.save_for_backward(h, w, index, out[2], out[3])
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        ctx.wd = wd  # the weight in the compute dtype, cast once (as autocast caches it for the full head)
        ctx.set_materialize_grads(False)  # a detached entropy's gradient stays None (no wasted (n, V) work)
        return out[0], out[1]

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        h, w, index, lse, ez = ctx.saved_tensors
        dtype, wd = ctx.dtype, ctx.wd
        N, V = h.shape[0], w.shape[0]
        dh = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        # dz is gathered over a span of up to 2^26 entries (128 MB in bf16) before the two matmuls: the (V, H) weight
        # gradient is then cast and summed once per span, not once per chunk (as costly as the chunk's matmul on CPU)
        span = max(ctx.chunk, 2**26 // V)
        for s0 in range(0, N, span):
            n = min(span, N - s0)
            dz_span = torch.empty(n, V, dtype=dtype, device=h.device)
            for s in range(s0, s0 + n, ctx.chunk):
                e = slice(s, min(s + ctx.chunk, s0 + n))
                z = _ChunkedHead.logits(h[e], wd, ctx.temperature, dtype)  # (n, V), as in the forward
                dz = torch.exp(z - lse[e, None])  # p, becoming dz in place (the fewest (n, V) temporaries)
                if g_ent is not None:  # dH/dz = -p (z - E_p[z]), into z
                    z.sub_(ez[e, None]).mul_(dz).mul_(g_ent[e, None])
                dz.mul_(-g_logp[e, None] if g_logp is not None else 0.0)  # d logp / dz = onehot - p
                if g_logp is not None:
                    dz.scatter_add_(-1, index[e, None], g_logp[e, None])
                if g_ent is not None:
                    dz.sub_(z)
                dz_span[e.start - s0 : e.stop - s0] = dz / ctx.temperature if ctx.temperature != 1.0 else dz
            if dh is not None:
                dh[s0 : s0 + n] = (dz_span @ wd).to(h.dtype)
            if dw is not None:
                dw += (dz_span.T @ h[s0 : s0 + n].to(dtype)).float()
        return dh, None if dw is None else dw.to(w.dtype), None, None, None, None


def entropy_from_logits(logits: torch.Tensor, chunk: int = 4, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: (B, T, V) -> (B, T), in float32, chunked as above.
    Naive: `-(p * log p).sum(-1)` with `p = softmax(logits.float() / temperature)`."""
    out = []
    for lg in logits.split(chunk):
        lg = lg.float() / temperature if temperature != 1.0 else lg.float()
        logp = torch.log_softmax(lg, dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------
def all_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the data-parallel processes (all of them, or one per TP group under --tp-size;
    x itself when not distributed). A new tensor; x is untouched. Used where a statistic must be the
    whole batch's, not one rank's slice of it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(STATE.dp_group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=STATE.dp_group)
    return x


def global_mean_divisor(count: torch.Tensor) -> torch.Tensor:
    """What to divide this rank's loss *sum* by so that, after DDP (or FSDP, DeepSpeed, or TP's
    data-parallel average) averages the ranks' gradients, the update is the mean over the whole minibatch
    on all ranks: (count summed over the data-parallel processes, at least 1) / their number. count: this
    rank's tokens (token-mean), sequences or pairs. The one token-mean rule of every script; ranks may hold
    different counts."""
    import torch.distributed as dist

    world = dist.get_world_size(STATE.dp_group) if dist.is_available() and dist.is_initialized() else 1
    return all_sum(count.float()).clamp(min=1) / world


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None, distributed: bool = False) -> torch.Tensor:
    """Mean of x where mask is 1. Naive: `x[mask.bool()].mean()` (dim=None) or a loop over rows.
    A row with an empty mask gives 0 (its sum is divided by 1), not NaN.
    distributed=True (dim=None only): the mean over every process's entries, as if one process held
    the whole batch (every process must call it)."""
    if dim is None:
        total, n = masked_sum(x, mask), mask.sum()
        if distributed:
            total, n = all_sum(total), all_sum(n)
        return total / n.clamp(min=1)
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, distributed: bool = False) -> torch.Tensor:
    """Variance of x over masked entries; unbiased (n-1) by default, as TRL/verl do.
    Naive: `x[mask.bool()].var(unbiased=unbiased)`. distributed=True: over all processes' entries
    (two passes, mean first: the sum-of-squares shortcut loses precision when |mean| >> std)."""
    mean = masked_mean(x, mask, distributed=distributed)
    sq, n = masked_sum((x - mean) ** 2, mask), mask.sum()
    if distributed:
        sq, n = all_sum(sq), all_sum(n)
    var = sq / n.clamp(min=1)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, distributed: bool = False
) -> torch.Tensor:
    """(x - mean) / std over masked entries (unbiased variance). With `shift_mean=False` the mean
    is added back: only the scale changes (used for rewards, so their sign is kept).
    Masked-out entries are returned as they were computed; callers multiply by the mask.
    distributed=True: mean and std of the global batch (all processes), so N processes whiten
    exactly as one process holding the whole batch would (verl's single controller does this)."""
    mean, var = masked_mean(x, mask, distributed=distributed), masked_var(x, mask, distributed=distributed)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------
# KL estimators (Schulman, "Approximating KL divergence", 2020)
# ---------------------------------------------------------------------------------------------
def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi. (B, T), (B, T) -> (B, T).

    With d = log pi - log pi_ref:
      k1 = d                      unbiased, high variance, can be negative per token
      k2 = d^2 / 2                biased, low variance, >= 0
      k3 = exp(-d) - 1 + d        unbiased, low variance, >= 0 ("low-var KL" in verl, GRPO paper)
    k3 is clamped to [-10, 10] as in verl (and -d to [-20, 20] before exp, so nothing overflows):
    one token whose ratio exploded (d = -10 gives exp(10) - 11 = 22015) cannot outweigh the rest
    of the sequence's reward."""
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return (torch.exp((-d).clamp(-20, 20)) - 1 + d).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


# ---------------------------------------------------------------------------------------------
# Sampler-trainer mismatch (rollouts sampled from mu: the engine; the loss's pi_old: the trainer)
# ---------------------------------------------------------------------------------------------
def rollout_correction(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cap: float = 0.0,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[torch.Tensor | None, dict]:
    """Importance correction for rollouts sampled from mu (the engine: another kernel, precision or engine than
    the trainer's) used by a loss written for pi_old, and the mismatch metrics. (B, T) each; collective under
    DDP (every rank calls it every step). Returns (weights (B, T) multiplying each token's loss, or None when
    cap == 0; {metric: float} of the whole batch).

    With d_t = log pi_old - log mu of a sampled token (mask 1), the ratio rho at `level`:
      token      rho_t = exp(d_t)
      sequence   rho_t = exp(sum_t d_t) for every token of the response (the exact ratio of the sequences)
      geometric  rho_t = exp(mean_t d_t) (the per-token geometric mean: length-independent)
    and the weight by `mode`, with threshold C = cap >= 1:
      truncate   w = min(rho, C)                 TIS (Yao et al. 2025; TRL *_truncate, verl rollout_is)
      mask       w = rho if rho <= C else 0      MIS (TRL *_mask, its default at sequence level, C = 3)
      reject     w = 1 if 1/C <= rho <= C else 0 rejection, no reweighting (verl rollout_rs)
    A masked or rejected token keeps its place in the loss's denominator (its loss is 0), as in TRL.

    Metrics (mean over the batch's tokens unless said):
      mismatch/kl               KL(mu || pi_old) per token, k3 on the samples of mu: rho - 1 - log rho, >= 0
      mismatch/mult_prob_error  mean of exp(|d_t|) (NeMo-RL's token_mult_prob_error; 1 = no mismatch)
      mismatch/ratio_max        the largest rho at `level` (over tokens, or responses)
      mismatch/capped_frac      tokens whose weight the threshold changed (truncated, masked, rejected); with a cap
      train/sampler_logprob_diff  mean |d_t|
    Naive equivalent: a loop over rows and tokens (tests/unit/test_ops.py)."""
    d = (old_logprobs - sampler_logprobs) * mask  # (B, T) 0 on padding
    n = all_sum(mask.sum()).clamp(min=1)
    if level == "token":
        log_rho = d  # (B, T)
    elif level in ("sequence", "geometric"):
        log_rho = d.sum(1, keepdim=True)  # (B, 1)
        if level == "geometric":
            log_rho = log_rho / mask.sum(1, keepdim=True).clamp(min=1)
        log_rho = log_rho.expand_as(d)  # (B, T)
    else:
        raise ValueError(f"unknown correction level {level!r}: use token, sequence or geometric")
    rho = torch.exp(log_rho.clamp(-20, 20))  # (B, T) a ratio that exploded stays finite
    k3 = (torch.expm1(d.clamp(-20, 20)) - d).clamp(min=0)  # (B, T) per token, whatever the level; expm1: exact at d ~ 0
    live = mask > 0
    rho_max = rho.masked_fill(~live, 0).max() if rho.numel() else torch.zeros((), device=rho.device)
    metrics = {
        "mismatch/kl": all_sum((k3 * mask).sum()) / n,
        "mismatch/mult_prob_error": all_sum((torch.exp(d.abs().clamp(max=20)) * mask).sum()) / n,
        "mismatch/ratio_max": _all_max(rho_max),
        "train/sampler_logprob_diff": all_sum((d.abs() * mask).sum()) / n,
    }
    weights = None
    if cap > 0:
        if mode == "truncate":
            weights, acted = rho.clamp(max=cap), rho > cap
        elif mode == "mask":
            weights, acted = torch.where(rho <= cap, rho, torch.zeros_like(rho)), rho > cap
        elif mode == "reject":
            acted = (rho > cap) | (rho < 1 / cap)
            weights = (~acted).float()
        else:
            raise ValueError(f"unknown correction mode {mode!r}: use truncate, mask or reject")
        weights = weights * mask  # (B, T)
        metrics["mismatch/capped_frac"] = all_sum((acted.float() * mask).sum()) / n
    return weights, {k: float(v) for k, v in metrics.items()}


def _all_max(x: torch.Tensor) -> torch.Tensor:
    """The max of a 0-dim tensor over the data-parallel processes."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(STATE.dp_group) > 1:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=STATE.dp_group)
    return x


# ---------------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    """Generalised advantage estimation over right-padded responses.

    rewards, values, mask: (B, T). The value after the last real token is 0 (the episode ends).
    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1};  returns = A + V.
    Padding positions get advantage 0 and return 0. Positions of mask 0 *between* real tokens (a multi-turn
    trajectory's observation tokens, common/core/envs.py) are skipped: t+1 is the next real token, so gamma and lam
    act across the model's tokens only, as if the observations were not there (GAE over the model's own steps).
    Naive equivalent: per row, keep the real tokens, a Python loop over them (tests/unit/test_ops.py). Returns
    (advantages, returns), each (B, T)."""
    values, rewards = values * mask, rewards * mask  # (B, T); V = 0 past the last real token
    adv = torch.zeros_like(rewards)  # (B, T)
    next_value = next_adv = torch.zeros_like(rewards[:, 0])  # (B,)
    for t in reversed(range(rewards.shape[1])):
        real = mask[:, t] > 0  # (B,)
        a = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        adv[:, t] = a * mask[:, t]
        next_adv = torch.where(real, a, next_adv)  # a masked position passes the next real token's on
        next_value = torch.where(real, values[:, t], next_value)
    return adv, (adv + values) * mask


def exact_div(a: int, b: int, what: str) -> int:
    """a // b, or a UserError (a ValueError) naming the flags (`what`) when b does not divide a."""
    if b <= 0 or a <= 0 or a % b != 0:
        raise UserError(
            f"{what}: {a} is not divisible by {b}" if a > 0 and b > 0 else f"{what}: sizes must be positive ({a}, {b})"
        )
    return a // b
