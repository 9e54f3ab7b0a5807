"""GRPO: critic-free, group-relative policy optimisation, with flags for its well-known variants and losses.

Docs: docs/algos/grpo.md. Shao et al. 2024 "DeepSeekMath" (GRPO); Liu et al. 2025 (Dr. GRPO); Yu et al. 2025
"DAPO"; Ahmadian et al. 2024 (RLOO); Zheng et al. 2025 (GSPO); Chen et al. 2025, MiniMax-M1 (CISPO); Gao et al.
2025 (SAPO).

Each iteration samples `num_prompts` prompts and G = `group_size` responses per prompt. A response's advantage is
its reward relative to the others of its group (no critic, no GAE), the same for every token of the response.
`update_epochs` (mu) passes of a policy loss follow (--loss-type: PPO's clipped token ratio, or GSPO, CISPO,
SAPO); an optional KL term to a frozen reference sits in the loss (not in the reward, unlike PPO). It reduces to
REINFORCE with a per-prompt baseline, a bound on how far the ratio to pi_old may push, and token- or
sequence-level averaging (--loss-agg): where the variants differ.

    python algos/grpo_llm.py                                        # SmolLM2-135M-Instruct on chain_sum_1d
    python algos/grpo_llm.py --scale-rewards none --loss-agg seq-mean-token-sum-norm   # Dr. GRPO
    python algos/grpo_llm.py --clip-eps-high 0.28 --dynamic-sampling --loss-agg token-mean \\
        --overlong-buffer 16 --kl-coef 0                                                # DAPO
    python algos/grpo_llm.py --baseline rloo --scale-rewards none                      # RLOO
    python algos/grpo_llm.py --loss-type gspo --update-epochs 2                         # GSPO (also cispo, sapo)
    accelerate launch --multi_gpu --num_processes 2 algos/grpo_llm.py                 # 2 processes

Legend: N prompts per rank, G samples per prompt, B = N*G sequences, P prompt length, T response length.
        b, t: rows of one micro-batch and its longest response (a micro-batch runs at its own lengths);
        prefixes mb_ (a minibatch: one optimizer step), micro (a micro-batch: one forward/backward).
"""

import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch
import tyro

from common.core.data import Sampler
from common.core.forwards import can_share_prompts, forward_by_micro_batch, forward_logprobs, micro_batches, padding_counts, reference_logprobs_fn
from common.core import models as M
from common.core.ops import exact_div, global_mean_divisor, kl_estimate, masked_mean, masked_var, rollout_correction
from common.core.sampling import Rollout, sample
from common.core.seeds import mix_seed, seed_everything
from common.parallel.accelerator import configure_deepspeed, make_accelerator, micro_batch_budget
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward, frozen_reference, unwrap_for_generation
from common.integrations.engines import make_engine
from common.integrations.inputs import rl_inputs
from common.harness.args import Check, EnvArgs, GenerationArgs, Group, MismatchArgs, ModelArgs, NonNegFloat, NonNegInt, OptimArgs, PackingArgs, PositiveFloat, PositiveInt, PromptArgs, RewardArgs, RunArgs, group
from common.harness.cli import cli
from common.harness.eval import evaluate_policy
from common.harness.health import HealthConfig
from common.harness.perf import mfu, step_perf
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    num_prompts: PositiveInt = 8
    """prompts per iteration, over all processes"""
    group_size: Annotated[int, tyro.conf.arg(aliases=("--num-generations",)), Check(ge=2, note="G-1 to compare")] = 4
    """G: responses sampled per prompt (a response's advantage compares it with the other G-1)"""
    mini_batch_size: PositiveInt = 32
    """sequences per optimizer step, over all processes"""
    update_epochs: Annotated[PositiveInt, tyro.conf.arg(aliases=("--num-iterations",))] = 1
    """mu: passes over each batch (1: on-policy, old log-probs = sampling log-probs); TRL's --num-iterations"""
    baseline: Literal["group-mean", "rloo"] = "group-mean"
    """group-mean (GRPO) or rloo (leave-one-out mean of the other G-1 rewards)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the group's std (GRPO), the batch's std, or not at all (Dr. GRPO)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (GRPO paper), seq-mean-token-sum-norm (Dr. GRPO: / max_new_tokens)"""
    clip_eps_low: PositiveFloat = 0.2
    """lower ratio clip: ratio >= 1 - eps_low"""
    clip_eps_high: PositiveFloat = 0.2
    """upper ratio clip: ratio <= 1 + eps_high (DAPO clip-higher: 0.28)"""
    loss_type: Literal["grpo", "gspo", "cispo", "sapo"] = "grpo"
    """policy loss: grpo (clipped token ratio, --clip-eps-*), gspo (clipped sequence ratio, --gspo-eps), cispo
    (capped stop-gradient ratio times log-prob, --cispo-eps-high), sapo (soft gate, --sapo-tau)"""
    gspo_eps: Annotated[tuple[float, float], Check(gt=0)] = (3e-4, 4e-4)
    """GSPO's clip of the sequence ratio: LOW HIGH, s in [1 - low, 1 + high] (the paper's 3e-4 4e-4)"""
    cispo_eps_high: PositiveFloat = 4.0
    """CISPO's cap of the ratio: weight <= 1 + eps_high (no lower bound; ScaleRL's truncation at 5)"""
    sapo_tau: Annotated[tuple[float, float], Check(gt=0)] = (1.0, 1.05)
    """SAPO's gate temperatures: POS NEG, where the advantage is positive / negative (the paper's 1.0 1.05)"""
    kl_coef: Annotated[NonNegFloat, tyro.conf.arg(aliases=("--beta",))] = 0.0
    """weight of the KL to the reference in the loss (0: no reference model is loaded)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator in the loss"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch"""
    max_resample_rounds: NonNegInt = 3
    """dynamic sampling: extra sampling rounds at most; a batch still short is filled with dropped groups"""
    overlong_buffer: NonNegInt = 0
    """DAPO soft overlong punishment: responses longer than max_new_tokens - buffer lose up to overlong_penalty"""
    overlong_penalty: float = 1.0
    """reward subtracted at max_new_tokens (linear from 0 at max_new_tokens - buffer)"""
    mask_truncated: bool = False
    """exclude responses cut at max_new_tokens from the loss (DAPO overlong filtering)"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """training-health warning thresholds (--health.kl-max, ...; docs/experiments.md)"""

    # --- memory: how a minibatch is cut into forward/backward passes (the same loss)
    micro_batch_size: PositiveInt = 8
    """sequences per forward/backward on one process"""
    share_prompts: bool = True
    """each group's prompt once per micro-batch, forward and backward: the same loss (forwards.can_share_prompts)"""
    packing: Group[PackingArgs] = group(PackingArgs)  # --micro-batch-tokens: micro-batches packed by length

    # --- the flags every script shares (common/harness/args.py), flat: --seed, --model-name-or-path, ...
    run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=100)
    model: Group[ModelArgs] = group(ModelArgs)
    data: Group[PromptArgs] = group(PromptArgs)
    rewards: Group[RewardArgs] = group(RewardArgs)
    gen: Group[GenerationArgs] = group(GenerationArgs)
    optim: Group[OptimArgs] = group(OptimArgs, learning_rate=5e-6)
    mismatch: Group[MismatchArgs] = group(MismatchArgs)  # --tis-cap, --tis-level, --tis-mode
    env: Group[EnvArgs] = group(EnvArgs)  # --env tools|feedback|file.py:Class, --max-turns, ... (docs/agents.md)
    old_logprobs_from: str = field(default="", init=False)
    """runtime: pi_old's source, 'current' (the update forward's own, detached) or 'trainer' (recomputed)"""


# ALGO LOGIC: the step's prompts and groups: one global draw, DAPO's dynamic sampling, the group reward keys
def draw_rows(sampler, train_rows, n: int, rank: int, W: int, seed: int, step: int, repeat: int = 1, round_: int = 0):
    """One global draw of `n` prompts (every process draws the same ids, so there is one sampler state), this
    process's n/W of them each repeated `repeat` times (a prompt's samples adjacent), and each row's own seed,
    mix_seed(seed, step, uid), uid the row's place in the step's global draws (`round_`: a resampling round, after
    the earlier rounds' rows). -> (rows (n/W * repeat,), seeds)"""
    local = n // W
    ids = sampler.take(n)[rank * local : (rank + 1) * local]  # this process's share
    rows = [train_rows[i] for i in ids for _ in range(repeat)]
    uid0 = (round_ * n + rank * local) * repeat
    return rows, [mix_seed(seed, step, uid0 + j) for j in range(len(rows))]


def take_informative_groups(parts: list[Rollout], G: int, n_groups: int, pad_id: int) -> tuple[Rollout, int]:
    """From sampled batches `parts` (a prompt's G samples adjacent), one batch of `n_groups` groups, those whose
    rewards differ first, then (if too few) groups of equal rewards to keep the batch size fixed.
    -> (batch, number of equal-reward groups used to fill)"""
    groups = [(k, j) for k, p in enumerate(parts) for j in range(len(p.rows) // G)]  # (batch, group in it)
    differ = [bool(parts[k].scores.view(-1, G)[j].std() > 0) for k, j in groups]  # rewards differ in the group
    informative = [g for g, d in zip(groups, differ) if d][:n_groups]
    filled = [g for g, d in zip(groups, differ) if not d][: n_groups - len(informative)]
    picks = [parts[k].take(list(range(j * G, (j + 1) * G))) for k, j in informative + filled]  # a group each
    return Rollout.cat(picks, pad_id), len(filled)


def dynamic_sampling(sample_round, G: int, n_groups: int, max_rounds: int, pad_id: int, most_missing=None):
    """DAPO's dynamic sampling (Yu et al. 2025): sample_round(0), sample_round(1), ... (each a Rollout of groups, a
    prompt's G samples adjacent) until `n_groups` groups hold rewards that differ, at most `max_rounds` extra rounds;
    most_missing(n): the largest shortfall over the processes, so that all of them run the same rounds (None: this
    process's own). Then take_informative_groups. -> (Rollout of n_groups groups, extra rounds, groups filled)"""
    parts, rounds = [sample_round(0)], 0
    while rounds < max_rounds:
        missing = n_groups - sum(int((p.scores.view(-1, G).std(1) > 0).sum()) for p in parts)
        if (most_missing(missing) if most_missing else missing) <= 0:
            break
        rounds += 1
        parts.append(sample_round(rounds))
    rollout, n_filled = take_informative_groups(parts, G, n_groups, pad_id)
    return rollout, rounds, n_filled


def group_metrics(accelerator, scores, solved, G: int) -> dict:
    """The reward keys over all processes' rows (scores, solved: (B,), a prompt's G adjacent): train/reward,
    train/reward_std, train/zero_std_groups (groups whose rewards are all equal: no signal) and train/solve_all,
    train/solve_none (groups every / no sample of which solved exactly)."""
    scores, solved = accelerator.gather(scores), accelerator.gather(solved).view(-1, G)  # (all B,), (all prompts, G)
    return {
        "train/reward": scores.mean().item(),
        "train/reward_std": scores.std().item(),
        "train/zero_std_groups": (scores.view(-1, G).std(1) == 0).float().mean().item(),
        "train/solve_all": (solved.min(1).values == 1).float().mean().item(),
        "train/solve_none": (solved.max(1).values == 0).float().mean().item(),
    }


def reward_by_data_source(rows, scores) -> dict:
    """{reward/<data_source>: mean score of this rank's rows of it} when the rows mix several sources, else {}."""
    names = sorted({x.data_source for x in rows})
    source = torch.tensor([names.index(x.data_source) for x in rows], device=scores.device)  # (B,) index in names
    return {f"reward/{s}": scores[source == i].mean().item() for i, s in enumerate(names)} if len(names) > 1 else {}


# ALGO LOGIC: advantages, reward shaping and loss aggregation
def compute_advantages(scores, group_size, baseline, scale_rewards, eps=1e-6):
    """scores: (N*G,) with a prompt's G samples adjacent -> advantages (N*G,). group-mean: score - group mean
    (GRPO); rloo: score - mean of the other G-1 (Ahmadian et al. 2024). Then divided by the group's unbiased std + eps
    (group), the global batch's std over all processes (batch; groups never straddle ranks, so the group statistics
    need no communication), or nothing (none, Dr. GRPO). A group of equal scores gives exactly 0, never NaN.
    eps = 1e-6 as in the GRPO reference code (TRL uses 1e-4)."""
    s = scores.view(-1, group_size)  # (N, G)
    if baseline == "group-mean":
        adv = s - s.mean(dim=1, keepdim=True)
    else:
        adv = s - (s.sum(dim=1, keepdim=True) - s) / (group_size - 1)
    if scale_rewards == "group":
        adv = adv / (s.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        adv = adv / (masked_var(scores, torch.ones_like(scores), distributed=True).sqrt() + eps)
    return adv.reshape(-1)


def overlong_penalty(lengths, max_new_tokens, buffer, factor):
    """DAPO soft overlong punishment: 0 up to max - buffer, then linearly down to -factor at max. (B,) -> (B,)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float)
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -factor * (excess / buffer).clamp(max=1)


def aggregate(token_loss, mask, loss_agg, n_tokens, n_seqs, max_new_tokens):
    """This micro-batch's share of the minibatch loss. token_loss, mask: (b, T); n_tokens, n_seqs:
    totals over the whole minibatch, so summing the shares of its micro-batches gives
      token-mean:               sum_i sum_t l_it / sum_i |o_i|
      seq-mean-token-mean:      (1/n) sum_i (1/|o_i|) sum_t l_it
      seq-mean-token-sum-norm:  (1/n) sum_i sum_t l_it / max_new_tokens   (Dr. GRPO's constant)"""
    masked = token_loss * mask
    if loss_agg == "token-mean":
        return masked.sum() / n_tokens
    if loss_agg == "seq-mean-token-mean":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs
    if loss_agg == "seq-mean-token-sum-norm":
        return masked.sum() / (n_seqs * max_new_tokens)
    raise ValueError(f"unknown --loss-agg {loss_agg!r}")


# ALGO LOGIC: the policy losses (--loss-type): f(logprobs, old_logprobs, advantages, mask, *its hyperparameters)
# -> (per-token loss (b, T), {statistic: (b, T)}), each statistic aggregated as the loss is and logged as train/<name>
def grpo_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """PPO's clipped surrogate per token, asymmetric (GRPO, Shao et al. 2024; DAPO's clip-higher):
    r = pi_theta / pi_old, l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)); clipped: the bound is active."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))  # as verl: a ratio that exploded stays finite
    pg1, pg2 = -advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    return torch.max(pg1, pg2), {"clip_frac": (pg2 > pg1).float()}


def sequence_ratio(logprobs, old_logprobs, mask):
    """GSPO's importance ratio of each response: s = exp(mean over its tokens of log pi_theta - log pi_old), (b, 1)."""
    log_s = ((logprobs - old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return torch.exp(log_s.clamp(-20, 20))


def gspo_loss(logprobs, old_logprobs, advantages, mask, eps_low, eps_high):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the sequence ratio s, clipped at the sequence
    level, l = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)) on every token of the response (the paper's eps
    3e-4 / 4e-4). GSPO-token (s_t = sg(s) pi_theta / sg(pi_theta)) has the same value and gradient here:
    advantages are per response."""
    s = sequence_ratio(logprobs, old_logprobs, mask)  # (b, 1)
    pg1, pg2 = -advantages * s, -advantages * torch.clamp(s, 1 - eps_low, 1 + eps_high)
    return torch.max(pg1, pg2).expand_as(logprobs), {"clip_frac": (pg2 > pg1).float().expand_as(logprobs)}


def cispo_loss(logprobs, old_logprobs, advantages, mask, eps_high):
    """CISPO (MiniMax-M1, Chen et al. 2025): REINFORCE weighted by the capped, stop-gradient ratio,
    l = -sg(min(r, 1 + eps_high)) A log pi_theta: no token's gradient is dropped (PPO's clip zeroes it), only its
    weight is capped; no lower bound, as in the paper. Clipped: the cap is active."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))
    weight = torch.clamp(ratio, max=1 + eps_high).detach()
    return -weight * advantages * logprobs, {"clip_frac": (ratio > 1 + eps_high).float()}


def sapo_loss(logprobs, old_logprobs, advantages, mask, tau_pos, tau_neg):
    """SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): a soft gate instead of the hard clip,
    l = -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos where A > 0, tau_neg where A < 0 (1.0 / 1.05 in the
    paper). Its gradient weight 4 g (1 - g) is 1 at r = 1 (the policy gradient on-policy) and decays smoothly
    away from it; "clipped" (gated): that weight is below 1/2."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    return -advantages * 4 / tau * gate, {"clip_frac": (4 * gate * (1 - gate) < 0.5).float()}


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    accelerator = make_accelerator(args.model)  # as launched: DDP, FSDP2, DeepSpeed or TP; --mixed-precision
    device, rank, W, G = accelerator.device, accelerator.process_index, accelerator.num_processes, args.group_size
    N = exact_div(args.num_prompts, W, "--num-prompts over the number of processes")  # prompts per rank
    local_mini_batch_size = exact_div(args.mini_batch_size, W, "--mini-batch-size over the number of processes")
    exact_div(args.num_prompts * G, args.mini_batch_size, "--num-prompts x --group-size over --mini-batch-size")
    exact_div(local_mini_batch_size, args.micro_batch_size, "--mini-batch-size per process over --micro-batch-size")
    micro_batch_tokens = micro_batch_budget(accelerator, args.packing.micro_batch_tokens)  # DeepSpeed: rows
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    accumulation = local_mini_batch_size // args.micro_batch_size
    configure_deepspeed(accelerator, args.micro_batch_size, accumulation, args.optim.max_grad_norm)
    seed_everything(args.run.seed)
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads
    T_max = args.gen.max_new_tokens  # the response length limit
    # the tokenizer, --reward's scorers, the prompts (--train-files / --val-files, else --task), --env's episodes
    inputs = rl_inputs(args.model, args.data, args.rewards, args.gen, args.env, accelerator)  # inputs.RLInputs
    max_len, tok, reward, train_rows, val_rows, episodes = inputs
    sampler = Sampler(len(train_rows), args.run.seed)

    # ALGO LOGIC: the policy and, when --kl-coef > 0, a frozen reference; no critic (the group is the baseline)
    policy = M.load_causal_lm(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    # kl_coef 0: no reference at all; with LoRA: the policy with its adapter disabled
    ref_policy = frozen_reference(accelerator, args.model, tok) if args.kl_coef > 0 and not args.model.lora_r else None
    n_updates = args.run.total_steps * args.update_epochs * (args.num_prompts * G // args.mini_batch_size)
    opt, sched = adamw(policy, args.optim, n_updates)
    policy_loss = {  # --loss-type: f(logprobs, old_logprobs, advantages, mask) -> (per-token loss, statistics)
        "grpo": partial(grpo_loss, eps_low=args.clip_eps_low, eps_high=args.clip_eps_high),
        "gspo": partial(gspo_loss, eps_low=args.gspo_eps[0], eps_high=args.gspo_eps[1]),
        "cispo": partial(cispo_loss, eps_high=args.cispo_eps_high),
        "sapo": partial(sapo_loss, tau_pos=args.sapo_tau[0], tau_neg=args.sapo_tau[1]),
    }[args.loss_type]
    # pi_old with one optimizer step per batch (mu = 1, one minibatch): the update forward's own log-probs, detached
    # (as TRL), filled during the update; a loss that reads them before it sets `my_loss.reads_pi_old = True`
    one_step = args.update_epochs == 1 and args.mini_batch_size == args.num_prompts * G and not args.mismatch.tis_cap
    pi_old_from_update = one_step and not getattr(policy_loss.func, "reads_pi_old", False)
    args.old_logprobs_from = "current" if pi_old_from_update else "trainer"  # recorded in args.json

    # ------------------------------------------------------- checkpoint state, run folder  # TRY NOT TO MODIFY
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=policy)  # resumed: the checkpoint's weights
    policy, opt, sched = accelerator.prepare(policy, opt, sched)
    # --rollout-engine vllm: the colocated engine; hf: None
    engine = make_engine(args.gen, args.model, tok, policy, accelerator, max_len, args.run.seed)
    evaluate = partial(  # greedy on --val-files (--env: through the environment)
        evaluate_policy, accelerator, policy, tok, reward, val_rows, T_max, args.micro_batch_size, engine, episodes
    )
    share = G if args.share_prompts and can_share_prompts(policy) else 1  # G: a group's rows together, its prompt once
    fwd = partial(forward_logprobs, policy, temperature=args.gen.temperature, share_prompts=share > 1)  # (B, T) fn
    ref_logprobs_of = reference_logprobs_fn(accelerator, ref_policy, policy, args.gen.temperature, share > 1)
    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    state = dict(sched=sched, sampler=sampler, guard=guard)
    run.begin(tok, {"policy": policy}, {"opt": ("policy", opt)}, state, evaluate=evaluate if val_rows else None)

    def sample_groups(step, round_) -> Rollout:
        """One global draw of prompts; this rank's share, each repeated G times, sampled and scored."""
        # (N*G,) rows, a prompt's samples adjacent; each row's own seed
        rows, seeds = draw_rows(sampler, train_rows, args.num_prompts, rank, W, args.run.seed, step, G, round_)
        with unwrap_for_generation(accelerator, policy, engine) as gen_model:  # one turn, or --env's trajectories
            return sample(gen_model, tok, rows, reward, episodes, device, seeds, engine, **args.gen.sampling())

    def most_missing(n: int) -> int:  # dynamic sampling: the largest shortfall over the processes
        return accelerator.gather(torch.tensor([n], device=device)).max().item()

    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        # ------------------------------------------------------------------ 1. rollout (+ dynamic sampling)
        t_step = t_gen = time.time()
        if args.dynamic_sampling:  # DAPO: keep groups whose rewards differ (resampled); all ranks run the same rounds
            rollout, rounds, n_filled = dynamic_sampling(
                partial(sample_groups, step), G, N, args.max_resample_rounds, tok.pad_token_id, most_missing
            )
        else:
            rollout, rounds, n_filled = sample_groups(step, 0), 0, 0
        gen_s = time.time() - t_gen
        # B = N*G rows: scores (B,), mask (B, T), query_mask (B, P); query_responses, attn (B, P+T); lengths (B,)
        rows, scores, mask, query_mask = rollout.rows, rollout.scores, rollout.mask, rollout.query_mask
        P, T = rollout.queries.shape[1], rollout.responses.shape[1]
        query_responses, attn, lengths = rollout.query_responses, rollout.attention_mask, rollout.lengths

        # ------------------------------------------------------------------ 2. reward shaping and advantages
        scores = scores + overlong_penalty(lengths, T_max, args.overlong_buffer, args.overlong_penalty)  # (B,)
        advantages = compute_advantages(scores, G, args.baseline, args.scale_rewards)  # (B,)
        loss_mask = mask * (~rollout.truncated).float()[:, None] if args.mask_truncated else mask  # (B, T)

        def split(ids):  # micro-batches: --micro-batch-size rows, or by --micro-batch-tokens
            return micro_batches(ids, query_mask, mask, args.micro_batch_size, micro_batch_tokens, accelerator, share)

        all_micros = split(list(range(len(rows))))  # for the no-grad forwards

        def by_micro(fn):  # (B, T): a no-grad forward, micro-batch by micro-batch
            return forward_by_micro_batch(fn, all_micros, query_responses, attn, P, T, lengths=share > 1) * mask

        with torch.no_grad(), accelerator.autocast():  # one region: bf16 weight copies cast once, not per micro-batch
            if pi_old_from_update:
                old_logprobs = torch.zeros_like(mask)  # (B, T) filled by the update's forward below
            else:
                old_logprobs = by_micro(fwd)  # (B, T)
            ref_logprobs = by_micro(ref_logprobs_of) if args.kl_coef > 0 else None  # (B, T)
        # sampler vs pi_old: --tis-* weights (B, T) of each token's loss, mismatch/* (after the update if pi_old is its)
        correction = partial(rollout_correction, old_logprobs, rollout.logprobs, mask, **args.mismatch.correction())
        tis_weights, mismatch = (None, {}) if pi_old_from_update else correction()

        # ------------------------------------------------------------------ 3. update
        t_train, stats, seq_ratios = time.time(), {}, []  # stats: name -> each micro-batch's share; GSPO's s
        g = torch.Generator().manual_seed(mix_seed(args.run.seed, step, rank))
        for it in range(args.update_epochs):
            perm = torch.randperm(len(rows), generator=g).tolist()
            for mb_start in range(0, len(rows), local_mini_batch_size):
                minibatch = perm[mb_start : mb_start + local_mini_batch_size]
                # token totals over the global minibatch / W: DDP/FSDP average the W ranks' gradients, so token-mean
                # is over all ranks' tokens (each rank holds len(minibatch) sequences: n_seqs needs no reduce)
                n_tokens, n_seqs = global_mean_divisor(loss_mask[minibatch].sum()), len(minibatch)
                micros = split(minibatch)
                for k, m in enumerate(micros):
                    # this micro-batch's rows at its own lengths: its longest prompt (m.p) and response (m.t)
                    mb, cut = m.ids, slice(P - m.p, P + m.t)
                    mb_mask, mb_loss_mask, mb_adv = mask[mb, : m.t], loss_mask[mb, : m.t], advantages[mb, None]
                    mb_qr, mb_attn = query_responses[mb, cut], attn[mb, cut]  # (b, p+t); masks (b, t); mb_adv (b, 1)
                    new_logprobs, entropy = fwd(mb_qr, mb_attn, m.p, with_entropy=True, lengths=m.lengths)  # (b, t)
                    if pi_old_from_update:  # the one optimizer step: pi_old = pi_theta now
                        old_logprobs[mb, : m.t] = new_logprobs.detach() * mb_mask
                    mb_old = old_logprobs[mb, : m.t]  # (b, t)
                    token_loss, loss_stats = policy_loss(new_logprobs, mb_old, mb_adv, mb_mask)
                    if tis_weights is not None:
                        token_loss = token_loss * tis_weights[mb, : m.t]
                    if args.loss_type == "gspo":  # its sequence ratios, logged
                        seq_ratios.append(sequence_ratio(new_logprobs.detach(), mb_old, mb_mask))

                    def agg(x):  # (b, t) -> this micro-batch's share of the minibatch's loss (--loss-agg)
                        return aggregate(x, mb_loss_mask, args.loss_agg, n_tokens, n_seqs, T_max)

                    pg, kl_term = agg(token_loss), torch.zeros((), device=device)
                    if ref_logprobs is not None:  # the KL term in the loss
                        kl_term = agg(kl_estimate(new_logprobs, ref_logprobs[mb, : m.t], args.kl_estimator))
                    backward(accelerator, policy, pg + args.kl_coef * kl_term, last=k == len(micros) - 1)
                    for key, v in dict(pg=pg, kl=kl_term, entropy=entropy, **loss_stats).items():  # (b, t) ones: agg
                        stats.setdefault(key, []).append((v if v.dim() == 0 else agg(v)).detach())
                guard.step(policy, opt, args.optim.max_grad_norm, "policy", step)  # these: no-ops under DeepSpeed
                sched.step()
                opt.zero_grad()
        train_s = time.time() - t_train
        # pi_old (the trainer's) vs the sampler's log-probs of the sampled tokens: mismatch/*, sampler_logprob_diff
        mismatch = mismatch or correction()[1]
        # train/kl as in the PPO scripts: per response, the token mean of KL(pi_old || pi_ref); batch mean
        kl = kl_estimate(old_logprobs, ref_logprobs, args.kl_estimator) * mask if args.kl_coef > 0 else None  # (B, T)
        mean_kl = accelerator.gather(masked_mean(kl, mask, dim=1)).mean().item() if kl is not None else 0.0

        # ------------------------------------------------------------------ 4. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
            n_minibatches = args.update_epochs * len(rows) // local_mini_batch_size

            def mean(xs):  # a statistic's micro-batch shares -> its mean over the minibatches and processes
                return accelerator.reduce(torch.stack(xs).sum() / n_minibatches, "mean").item()

            step_s = time.time() - t_step
            padded, real = padding_counts(all_micros, query_mask, mask, share)  # tokens the forward passes ran
            n_fwd = 1 + (not pi_old_from_update) + (args.kl_coef > 0)  # generation, pi_old, reference
            metrics = {
                **group_metrics(accelerator, scores, rollout.solved, G),  # reward, reward_std, zero_std_groups, ...
                "train/kl": mean_kl,
                "train/kl_coef": args.kl_coef,
                **mismatch,
                **{f"train/{k}": mean(v) for k, v in stats.items() if k not in ("pg", "kl")},  # entropy, clip_frac, ...
                "train/lr": sched.get_last_lr()[0],
                "train/resample_rounds": rounds,
                "train/filled_zero_std_groups": n_filled,
                "train/episodes": step * args.num_prompts * G,
                "train/skipped_steps": guard.skipped,
                "loss/policy": mean(stats["pg"]),
                "loss/kl": mean(stats["kl"]),
                "loss/total": mean(stats["pg"]) + args.kl_coef * mean(stats["kl"]),
                **step_perf(accelerator, engine, step_s, gen_s, train_s, lengths, (padded, real)),  # perf/*
                "perf/mfu": mfu(policy, n_fwd * real, args.update_epochs * real, step_s, accelerator),
            }
            metrics.update(rollout.metrics(accelerator))  # response_len, truncated, reward/<term>, env/*, env/tool_*
            if seq_ratios:  # GSPO: the sequence importance ratios the loss clipped
                s = accelerator.gather(torch.cat(seq_ratios).flatten())
                metrics.update({f"train/seq_ratio_{k}": getattr(s, k)().item() for k in ("mean", "min", "max")})
            metrics.update(reward_by_data_source(rows, scores))  # reward/<source> when the batch mixes sources
            metrics.update(reward.counts())  # reward/errors, reward/judge_unparsed: since the start, when nonzero
            run.log(step, metrics, rollout.samples(scores, advantage=advantages))  # + evaluation when due, --save-best

    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = (
    "--model-name-or-path {tiny_peaky} --max-new-tokens 6 --num-eval-prompts 4 --num-prompts 2 --group-size 2 "
    "--mini-batch-size 4 --micro-batch-size 2 --train-files {toy_prompts} --val-files {toy_prompts} "
    "--reward-fn {toy_reward}"
)


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
