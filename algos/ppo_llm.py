"""PPO for language models: policy + critic + frozen reference + reward, GAE, KL penalty in the reward.

Docs: docs/algos/ppo.md. References: Ziegler et al. 2019 "Fine-Tuning Language Models from Human
Preferences" (adaptive KL controller), Ouyang et al. 2022 (InstructGPT), Huang et al. 2024
"The N+ Implementation Details of RLHF with PPO" (lm-human-preference-details).

Each iteration: (1) sample `batch_size` prompts and one response each; (2) score them: the sequence
reward sits on the last real token, every token pays -beta * (log pi - log pi_ref); (3) the critic's
values and GAE turn those per-token rewards into advantages; (4) `update_epochs` passes of the clipped
surrogate + clipped value loss over shuffled minibatches; (5) beta moves toward `kl_target` when
one is set; (6) log, evaluate, checkpoint.

"KL" (train/kl, and what --kl-target aims at) is the mean over response tokens of
log pi - log pi_ref per sequence, averaged over the batch: a per-token number, so 0.1 is sensible.

    python algos/ppo_llm.py                                   # SmolLM2-135M-Instruct on chain_sum_1d
    python algos/ppo_llm.py --kl-target 0.1 --total-steps 200 --track
    accelerate launch algos/ppo_llm.py --kl-target 0.1
    accelerate launch --multi_gpu --num_processes 2 algos/ppo_llm.py   # 2 processes (gloo on CPU)
    python -c "from common.core.models import tiny_model; tiny_model('/tmp/tiny')"        # smoke test: a tiny model,
    python algos/ppo_llm.py --model-name-or-path /tmp/tiny --total-steps 2 --batch-size 4 \\
        --mini-batch-size 2 --micro-batch-size 2 --max-new-tokens 8                    # then 2 iterations

Legend: B rollouts per rank, P prompt length (left-padded), T response length, V vocabulary.
        b, t: rows of one micro-batch and its longest response (a micro-batch runs at its own lengths);
        prefixes mb_ (a minibatch: one optimizer step), micro (a micro-batch: one forward/backward).
"""

import sys
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch
import tyro

from common.core.data import Sampler
from common.core.forwards import forward_by_micro_batch, forward_logprobs, forward_values, micro_batches, padding_counts, reference_logprobs_fn
from common.core import models as M
from common.core.ops import exact_div, gae, global_mean_divisor, kl_estimate, masked_mean, masked_whiten, rollout_correction
from common.core.sampling import sample
from common.core.seeds import mix_seed, seed_everything
from common.parallel.accelerator import configure_deepspeed, make_accelerator, micro_batch_budget
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward, frozen_reference, unwrap_for_generation
from common.integrations.engines import make_engine
from common.integrations.inputs import rl_inputs
from common.harness.args import Check, EnvArgs, GenerationArgs, Group, MismatchArgs, ModelArgs, NonNegFloat, NonNegInt, OptimArgs, PackingArgs, PositiveFloat, PositiveInt, PromptArgs, RewardArgs, RunArgs, UnitFloat, group
from common.harness.cli import cli
from common.harness.eval import evaluate_policy
from common.harness.health import HealthConfig
from common.harness.perf import mfu, step_perf
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    batch_size: PositiveInt = 16
    """rollouts per iteration, over all processes"""
    mini_batch_size: PositiveInt = 8
    """rollouts per optimizer step, over all processes"""
    update_epochs: Annotated[PositiveInt, tyro.conf.arg(aliases=("--ppo-epochs",))] = 2
    """passes over the rollout batch per iteration (CleanRL's update_epochs; --ppo-epochs works too)"""
    gamma: UnitFloat = 1.0
    """discount"""
    lam: UnitFloat = 0.95
    """GAE lambda"""
    clip_eps: PositiveFloat = 0.2
    """policy ratio clip"""
    dual_clip_c: Annotated[Optional[float], Check(gt=1)] = None
    """dual-clip constant (> 1) bounding the loss for negative advantages (Ye et al. 2020)"""
    ent_coef: NonNegFloat = 0.0
    """entropy bonus weight"""
    kl_coef: NonNegFloat = 0.05
    """initial beta of the per-token KL penalty in the reward"""
    kl_target: Annotated[Optional[float], Check(gt=0, note="omit it for a fixed --kl-coef")] = None
    """if set, beta adapts so the measured KL approaches this (Ziegler et al.)"""
    kl_horizon: PositiveInt = 10000
    """adaptive controller horizon (samples)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """per-token KL estimator in the reward penalty"""
    whiten_rewards: bool = False
    """scale per-token rewards to unit variance (mean kept) before GAE"""
    whiten_advantages: bool = True
    """whiten advantages over the batch"""
    critic_warmup_steps: NonNegInt = 0
    """first N iterations train only the critic"""
    missing_eos_penalty: NonNegFloat = 0.0
    """subtracted from the score of responses that end without EOS"""
    # CRITIC {  the value model V (a copy without it deletes every CRITIC block and line)
    critic_model: Optional[str] = None
    """critic body (default: the policy's weights); its value head starts at zero"""
    critic_learning_rate: PositiveFloat = 2e-5
    """critic learning rate (the policy's: --learning-rate)"""
    clip_eps_value: PositiveFloat = 0.2
    """value clip around the rollout's values"""
    vf_coef: NonNegFloat = 0.1
    """value loss weight"""
    # CRITIC }
    health: HealthConfig = field(default_factory=HealthConfig)
    """training-health warning thresholds (--health.kl-max, ...; docs/experiments.md)"""

    # --- memory: how a minibatch is cut into forward/backward passes (the same loss)
    micro_batch_size: PositiveInt = 8
    """rollouts per forward/backward on one process (gradient accumulation up to the minibatch)"""
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


# ALGO LOGIC: the PPO losses
class KLController:
    """beta of the KL penalty in the reward. Fixed when target is None; else adaptive (Ziegler et al.
    2019, lm-human-preferences): e = clip(KL / target - 1, -0.2, 0.2), beta <- beta * (1 + e * n / horizon),
    n = the samples in the batch just trained on."""

    def __init__(self, kl_coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        if self.target:
            err = min(max(current_kl / self.target - 1, -0.2), 0.2)
            self.value *= 1 + err * n_samples / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"] if isinstance(state, dict) else state  # older dynamic-KL checkpoints: a float


def policy_loss(logprobs, old_logprobs, advantages, mask, n_tokens, clip_eps, dual_clip_c=None, tis_weights=None):
    """Clipped surrogate, summed over masked tokens and divided by the minibatch's token count.
    All (b, T) except n_tokens (scalar); tis_weights (b, T) multiply each token's loss (--tis-cap).
    Returns (loss, {statistic: value}) as sums over tokens / n_tokens; each statistic is logged as train/<name>."""
    log_ratio = (logprobs - old_logprobs).clamp(-20, 20)  # as verl: a ratio that exploded stays finite
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    pg = torch.max(pg1, pg2)
    if dual_clip_c is not None:  # for A < 0 the loss is at most -A * c
        pg = torch.where(advantages < 0, torch.min(pg, -advantages * dual_clip_c), pg)
    if tis_weights is not None:
        pg = pg * tis_weights
    clip_frac = ((pg2 > pg1).float() * mask).sum() / n_tokens
    approx_kl = (0.5 * log_ratio**2 * mask).sum() / n_tokens
    return (pg * mask).sum() / n_tokens, {"clip_frac": clip_frac, "approx_kl": approx_kl}


# CRITIC {
def value_loss(values, old_values, returns, mask, n_tokens, clip_eps_value):
    """0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2), token-summed / n_tokens. All (b, T)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    loss = 0.5 * torch.max((values - returns) ** 2, (v_clipped - returns) ** 2)
    return (loss * mask).sum() / n_tokens


# CRITIC }


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    accelerator = make_accelerator(args.model)  # as launched: DDP, FSDP2, DeepSpeed or TP; --mixed-precision
    device, rank, W = accelerator.device, accelerator.process_index, accelerator.num_processes
    local_batch_size = exact_div(args.batch_size, W, "--batch-size over the number of processes")
    local_mini_batch_size = exact_div(args.mini_batch_size, W, "--mini-batch-size over the number of processes")
    exact_div(args.batch_size, args.mini_batch_size, "--batch-size over --mini-batch-size")
    exact_div(local_mini_batch_size, args.micro_batch_size, "--mini-batch-size per process over --micro-batch-size")
    micro_batch_tokens = micro_batch_budget(accelerator, args.packing.micro_batch_tokens)  # DeepSpeed: rows
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    accumulation = local_mini_batch_size // args.micro_batch_size
    configure_deepspeed(accelerator, args.micro_batch_size, accumulation, args.optim.max_grad_norm)
    seed_everything(args.run.seed)
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads
    # the tokenizer, --reward's scorers, the prompts (--train-files / --val-files, else --task), --env's episodes
    inputs = rl_inputs(args.model, args.data, args.rewards, args.gen, args.env, accelerator)  # inputs.RLInputs
    max_len, tok, reward, train_rows, val_rows, episodes = inputs
    sampler = Sampler(len(train_rows), args.run.seed)

    # ALGO LOGIC: PPO's models and optimizers: the policy, a critic (value model), a frozen reference
    # for the KL penalty in the reward (none when --kl-coef 0 and no --kl-target), the KL controller
    policy = M.load_causal_lm(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    use_ref = args.kl_coef > 0 or args.kl_target is not None
    # with LoRA the reference is the policy with its adapter disabled
    ref_policy = frozen_reference(accelerator, args.model, tok) if use_ref and not args.model.lora_r else None
    n_updates = args.run.total_steps * args.update_epochs * (args.batch_size // args.mini_batch_size)
    opt, sched = adamw(policy, args.optim, n_updates)
    # CRITIC {
    critic = M.load_value_model(args.critic_model or args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    critic_opt, critic_sched = adamw(critic, args.optim, n_updates, lr=args.critic_learning_rate)
    # CRITIC }
    kl_ctl = KLController(args.kl_coef, args.kl_target, args.kl_horizon)

    # ------------------------------------------------------- checkpoint state, run folder  # TRY NOT TO MODIFY
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=policy)  # resumed: the checkpoint's weights
    # one model per call: FSDP2 pairs it with its optimizer
    policy, opt, sched = accelerator.prepare(policy, opt, sched)
    # what a checkpoint holds, by name (restored here when resuming)
    models, optimizers = {"policy": policy}, {"opt": ("policy", opt)}
    state = dict(sched=sched, sampler=sampler, kl_ctl=kl_ctl, guard=guard)
    # CRITIC {
    run.load_weights(critic=critic)
    critic, critic_opt, critic_sched = accelerator.prepare(critic, critic_opt, critic_sched)
    models["critic"], optimizers["critic_opt"], state["critic_sched"] = critic, ("critic", critic_opt), critic_sched
    # CRITIC }
    # --rollout-engine vllm: the colocated engine; hf: None
    engine = make_engine(args.gen, args.model, tok, policy, accelerator, max_len, args.run.seed)
    T_max = args.gen.max_new_tokens  # the response length limit
    evaluate = partial(  # greedy on --val-files (--env: through the environment)
        evaluate_policy, accelerator, policy, tok, reward, val_rows, T_max, args.micro_batch_size, engine, episodes
    )
    # (B, T) fn at the sampling temperature; the entropy a detached statistic without the bonus (--ent-coef 0)
    fwd = partial(forward_logprobs, policy, temperature=args.gen.temperature, entropy_grad=args.ent_coef != 0)
    ref_logprobs_of = reference_logprobs_fn(accelerator, ref_policy, policy, args.gen.temperature)  # (B, T) fn
    run.begin(tok, models, optimizers, state, evaluate=evaluate if val_rows else None)  # + evaluation before step 1

    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. rollout
        ids = sampler.take(args.batch_size)[rank * local_batch_size : (rank + 1) * local_batch_size]  # this rank's
        rows = [train_rows[i] for i in ids]
        seeds = [mix_seed(args.run.seed, step, rank * local_batch_size + j) for j in range(len(rows))]
        t_gen = time.time()
        # one turn, or --env's trajectories (observations get mask 0: no loss, GAE skips them); pi_old reuses the
        # prompts' KV cache (checkpointed layers keep none)
        sampling = dict(args.gen.sampling(), keep_prompt_cache=not args.model.gradient_checkpointing)
        with unwrap_for_generation(accelerator, policy, engine) as gen_model:
            rollout = sample(gen_model, tok, rows, reward, episodes, device, seeds, engine, **sampling)
        gen_s, P, T = time.time() - t_gen, rollout.queries.shape[1], rollout.responses.shape[1]
        # scores (B,), mask (B, T), query_mask (B, P); query_responses, attn (B, P+T)
        scores, mask, query_mask = rollout.scores, rollout.mask, rollout.query_mask
        query_responses, attn = rollout.query_responses, rollout.attention_mask

        # ------------------------------------------------------------------ 2. score
        scores = scores - args.missing_eos_penalty * (~rollout.is_eos).float()

        def split(ids):  # micro-batched (bounds peak memory): --micro-batch-size rows, or by --micro-batch-tokens
            return micro_batches(ids, query_mask, mask, args.micro_batch_size, micro_batch_tokens, accelerator)

        def by_micro(fn, cache=None):  # (B, T): a no-grad forward, micro-batch by micro-batch
            return forward_by_micro_batch(fn, all_micros, query_responses, attn, P, T, cache) * mask

        all_micros = split(list(range(len(rows))))
        with torch.no_grad(), accelerator.autocast():  # one region: bf16 weight copies cast once, not per micro-batch
            logprobs = by_micro(fwd, rollout.prompt_cache)  # (B, T) pi_old: responses over the prompts' KV cache
            rollout.prompt_cache = None  # its memory back before the update
            values = torch.zeros_like(mask)  # (B, T) V_old; 0 without a critic (GAE: the discounted reward to go)
            values = by_micro(partial(forward_values, critic))  # CRITIC
            ref_logprobs = by_micro(ref_logprobs_of) if use_ref else logprobs
        # pi_old is the trainer's recomputed log-probs; the sampler's (KV cache, maybe another precision
        # or engine) can differ: the gap is metrics (mismatch/*), and --tis-* corrects for it: weights (B, T) or None
        tis_weights, mismatch = rollout_correction(logprobs, rollout.logprobs, mask, **args.mismatch.correction())
        kl = kl_estimate(logprobs, ref_logprobs, args.kl_estimator) * mask  # (B, T) per-token KL
        # (B, T): the score on each row's last model token; --env: each step's reward on its turn's last model token
        rewards = -kl_ctl.value * kl + rollout.token_scores(scores)

        # ------------------------------------------------------------------ 3. advantages
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, distributed=True) * mask  # global batch stats
        advantages, returns = gae(rewards, values, mask, args.gamma, args.lam)  # (B, T) each
        if args.whiten_advantages:
            advantages = masked_whiten(advantages, mask, distributed=True) * mask  # global batch stats

        # ------------------------------------------------------------------ 4. update
        t_train = time.time()
        stats = {k: [] for k in ("pg", "vf", "ent")}  # + the loss's own statistics
        train_policy = step > args.critic_warmup_steps
        g = torch.Generator().manual_seed(mix_seed(args.run.seed, step, rank))
        for epoch in range(args.update_epochs):
            perm = torch.randperm(len(rows), generator=g).tolist()
            for mb_start in range(0, len(rows), local_mini_batch_size):
                minibatch = perm[mb_start : mb_start + local_mini_batch_size]
                # token-mean over the global minibatch: DDP/FSDP average the W ranks' gradients, so
                # each rank divides by (all ranks' tokens) / W
                n_tokens = global_mean_divisor(mask[minibatch].sum())
                micros = split(minibatch)
                # CRITIC {
                # the critic's pass, then the policy's: disjoint graphs, one model's alive at a time (peak memory);
                # under DeepSpeed each engine steps itself at its last micro-batch
                for k, m in enumerate(micros):
                    # this micro-batch's rows at its own lengths: its longest prompt (m.p) and response (m.t)
                    mb, cut = m.ids, slice(P - m.p, P + m.t)
                    mb_qr, mb_attn, mb_mask = query_responses[mb, cut], attn[mb, cut], mask[mb, : m.t]
                    mb_values, mb_returns = values[mb, : m.t], returns[mb, : m.t]  # (b, t)
                    new_values = forward_values(critic, mb_qr, mb_attn, m.p)  # (b, t)
                    vf = value_loss(new_values, mb_values, mb_returns, mb_mask, n_tokens, args.clip_eps_value)
                    backward(accelerator, critic, args.vf_coef * vf, k == len(micros) - 1)
                    stats["vf"].append(vf.detach())
                # CRITIC }
                for k, m in enumerate(micros):
                    mb, cut = m.ids, slice(P - m.p, P + m.t)
                    mb_qr, mb_attn, mb_mask = query_responses[mb, cut], attn[mb, cut], mask[mb, : m.t]
                    mb_old, mb_adv = logprobs[mb, : m.t], advantages[mb, : m.t]  # (b, t)
                    mb_tis = tis_weights[mb, : m.t] if tis_weights is not None else None  # (b, t) or None
                    last = k == len(micros) - 1  # the minibatch's last micro-batch
                    with torch.set_grad_enabled(train_policy):  # critic warm-up: no policy graph
                        new_logprobs, entropy = fwd(mb_qr, mb_attn, m.p, with_entropy=True)  # (b, t) each
                    pg, loss_stats = policy_loss(
                        new_logprobs, mb_old, mb_adv, mb_mask, n_tokens, args.clip_eps, args.dual_clip_c, mb_tis
                    )
                    ent = (entropy * mb_mask).sum() / n_tokens
                    if train_policy:
                        backward(accelerator, policy, pg - args.ent_coef * ent, last)
                    for key, v in dict(pg=pg, ent=ent, **loss_stats).items():
                        stats.setdefault(key, []).append(v.detach())
                if train_policy:  # (clip, step, zero_grad: no-ops under DeepSpeed, whose engines stepped in backward)
                    guard.step(policy, opt, args.optim.max_grad_norm, "policy", step)
                    sched.step()
                guard.step(critic, critic_opt, args.optim.max_grad_norm, "critic", step)  # CRITIC
                critic_sched.step()  # CRITIC
                opt.zero_grad()
                critic_opt.zero_grad()  # CRITIC
        train_s = time.time() - t_train

        # ------------------------------------------------------------------ 5. KL controller
        mean_kl = accelerator.gather(masked_mean(kl, mask, dim=1)).mean().item()  # per-token KL, batch mean
        kl_coef_used = kl_ctl.value
        kl_ctl.update(mean_kl, args.batch_size)

        # ------------------------------------------------------------------ 6. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
            # each stat holds per-micro-batch parts of a minibatch mean; their sum / #minibatches: the minibatches' mean
            n_minibatches = args.update_epochs * len(rows) // local_mini_batch_size

            def mean(xs):  # a statistic's micro-batch shares -> its mean over the minibatches and processes
                return accelerator.reduce(torch.stack(xs).sum() / n_minibatches, "mean").item()

            all_scores, step_s = accelerator.gather(scores), time.time() - t_step
            padded, real = padding_counts(all_micros, query_mask, mask)  # tokens of the batch's forward passes
            metrics = {
                "train/reward": all_scores.mean().item(),
                "train/reward_std": all_scores.std().item(),
                "train/kl": mean_kl,
                "train/kl_coef": kl_coef_used,
                **mismatch,
                "train/entropy": mean(stats["ent"]),
                **{f"train/{k}": mean(stats[k]) for k in loss_stats},  # the loss's own: clip_frac, approx_kl
                "train/lr": sched.get_last_lr()[0],
                "train/value_mean": masked_mean(values, mask, distributed=True).item(),  # CRITIC
                "train/episodes": step * args.batch_size,
                "train/skipped_steps": guard.skipped,
                "loss/policy": mean(stats["pg"]),
                "loss/value": mean(stats["vf"]),  # CRITIC
                "loss/total": mean(stats["pg"]) - args.ent_coef * mean(stats["ent"]),  # + the value term below
                **step_perf(accelerator, engine, step_s, gen_s, train_s, rollout.lengths, (padded, real)),  # perf/*
                # real tokens run forward only (generation, pi_old, reference; the critic's values) and trained
                "perf/mfu": mfu(policy, (2 + use_ref) * real, args.update_epochs * real, step_s, accelerator),
            }
            metrics["loss/total"] += args.vf_coef * metrics["loss/value"]  # CRITIC
            metrics["perf/mfu"] += mfu(critic, real, args.update_epochs * real, step_s, accelerator)  # CRITIC
            metrics.update(rollout.metrics(accelerator))  # response_len, truncated, reward/<term>, env/*, env/tool_*
            metrics.update(reward.counts())  # reward/errors, reward/judge_unparsed: since the start, when nonzero
            run.log(step, metrics, rollout.samples(scores, kl=masked_mean(kl, mask, dim=1)))  # + evaluation

    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = (
    "--model-name-or-path {tiny} --max-new-tokens 6 --num-eval-prompts 4 --batch-size 4 --mini-batch-size 4 "
    "--micro-batch-size 2"
)


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
