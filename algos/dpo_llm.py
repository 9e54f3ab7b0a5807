"""DPO and its loss variants, on offline preference pairs or pairs sampled from the policy (online).

Docs: docs/algos/dpo.md. Rafailov et al. 2023 "Direct Preference Optimization" (sigmoid loss);
Mitchell 2023 "conservative DPO" (label smoothing); Azar et al. 2023 (IPO); Zhao et al. 2023
SLiC (hinge); Chowdhury et al. 2024 (robust DPO); Pang et al. 2024 / RPO (an SFT term on chosen);
Guo et al. 2024 and Xiong et al. 2024 (online / iterative DPO).

DPO needs no reward model and no sampling: with z = [log pi(y_c) - log ref(y_c)] - [log pi(y_r) - log ref(y_r)]
(log-probs summed over response tokens), the sigmoid loss is -log sigmoid(beta * z). It reduces to
logistic regression on preference pairs, with the policy's log-ratio to the reference as the logit.
With `--online`, each step samples `--group-size` responses per prompt from the current policy,
scores them with the reward registry, and trains on best vs worst (ties skipped).

    python algos/dpo_llm.py                                     # SmolLM2-135M-Instruct, built-in chain_sum_1d pairs
    python algos/dpo_llm.py --train-files pairs.parquet --val-files pairs_test.parquet --loss-type ipo
    python algos/dpo_llm.py --online --train-files data/chain_sum_1d/train.parquet   # online DPO on a prompt set
    python -m tools.gen_preferences --model runs/ppo_llm__.../checkpoints/step_100/policy --out pairs.parquet
    accelerate launch algos/dpo_llm.py --lora-r 16

Legend: B pairs per rank, L = prompt + response length, V vocabulary.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch
import torch.nn.functional as F
import tyro

from common.core import chat
from common.core.data import Sampler, encode_prompt_response, load_preferences, load_prompts
from common.core.errors import UserError
from common.core.forwards import can_share_prompts, forward_logprobs, rows_as_rollout, token_logprobs
from common.core.generation import generate, tokenize_queries
from common.core import models as M
from common.core.ops import exact_div, global_mean_divisor
from common.core.rewards import Reward
from common.core.tasks import default_preference_files, default_task_files
from common.core.seeds import mix_seed, seed_everything
from common.parallel.accelerator import configure_deepspeed, make_accelerator
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward, frozen_reference, unwrap_for_generation
from common.integrations.engines import engine_perf, make_engine
from common.integrations.inputs import reward_from_args
from common.harness.args import Check, DataArgs, Group, ModelArgs, NonNegFloat, NonNegInt, OnlineGenerationArgs, OptimArgs, PositiveFloat, PositiveInt, RewardArgs, RunArgs, group
from common.harness.cli import cli
from common.harness.eval import evaluate_policy
from common.harness.perf import peak_mem_gb
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """sigmoid (DPO), ipo (length-normalised log-ratios), hinge (SLiC), robust (noisy labels)"""
    beta: PositiveFloat = 0.1
    """inverse temperature of the implicit reward"""
    label_smoothing: Annotated[NonNegFloat, Check(lt=0.5)] = 0.0
    """assumed probability that a label is flipped (conservative DPO for sigmoid; robust DPO's epsilon)"""
    sft_coef: NonNegFloat = 0.0
    """weight of an SFT (NLL per token) term on the chosen response (RPO)"""
    batch_size: PositiveInt = 16
    """pairs (offline) or prompts (online) per step, over all processes"""
    online: bool = False
    """sample pairs from the current policy each step (best vs worst by the reward)"""
    group_size: Annotated[PositiveInt, tyro.conf.arg(aliases=("--num-samples",))] = 4
    """G: responses sampled per prompt when --online (>= 2), as in grpo_llm.py"""
    precompute_ref: bool = False
    """compute reference log-probs of all offline pairs once before training"""
    share_prompts: bool = True
    """each pair's prompt once per forward and backward, chosen and rejected after it: the same loss"""

    # --- pairs and evaluation
    max_prompt_length: PositiveInt = 256
    """prompt tokens kept (the last ones)"""
    max_completion_length: PositiveInt = 64
    """response tokens kept (the first ones)"""
    eval_prompt_files: Optional[list[str]] = None
    """prompt files for eval/accuracy by greedy decoding (default: the built-in task's test split)"""
    num_eval_pairs: NonNegInt = 64
    """held-out pairs per evaluation"""
    num_eval_prompts: NonNegInt = 64
    """prompts per greedy evaluation"""

    # --- memory
    micro_batch_size: PositiveInt = 4
    """pairs per forward/backward on one process"""

    # --- the flags every script shares (common/harness/args.py), flat: --seed, --model-name-or-path, ...
    run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=100)
    model: Group[ModelArgs] = group(ModelArgs)
    data: Group[DataArgs] = group(DataArgs)
    """preference files (prompt, chosen, rejected); with --online, prompt files (verl schema)"""
    rewards: Group[RewardArgs] = group(RewardArgs)
    """--online: the reward that ranks the samples"""
    gen: Group[OnlineGenerationArgs] = group(OnlineGenerationArgs)
    """--online sampling and evaluation, the rollout engine"""
    optim: Group[OptimArgs] = group(OptimArgs, learning_rate=5e-7)


# ALGO LOGIC: the DPO losses
def dpo_loss(pi_c, pi_r, ref_c, ref_r, loss_type, beta, label_smoothing=0.0):
    """Per-pair loss. Inputs (B,): summed response log-probs (for ipo: mean per token).
    z = (pi_c - ref_c) - (pi_r - ref_r)
      sigmoid: -(1-eps) log sig(beta z) - eps log sig(-beta z)
      ipo:     (z - 1/(2 beta))^2
      hinge:   relu(1 - beta z)
      robust:  (-(1-eps) log sig(beta z) + eps log sig(-beta z)) / (1 - 2 eps)"""
    z = (pi_c - ref_c) - (pi_r - ref_r)
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "robust":
        return (-(1 - label_smoothing) * F.logsigmoid(beta * z) + label_smoothing * F.logsigmoid(-beta * z)) / (
            1 - 2 * label_smoothing
        )
    raise ValueError(f"unknown --loss-type {loss_type!r}")


def encode_pairs(tok, pairs, max_prompt_length, max_completion_length, device):
    """Chosen and rejected of each pair as one right-padded batch [chosen..., rejected...] (the shared
    encoder). Completions are texts (EOS appended) or, with --online, the policy's own token ids (kept
    as generated: a truncated sample gets no EOS it never emitted).
    Returns input_ids, attention_mask, response_mask: (2B, L)."""
    return encode_prompt_response(
        tok,
        [p["prompt"] for p in pairs] * 2,
        [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
        eos=True,
        max_prompt_length=max_prompt_length,
        max_completion_length=max_completion_length,
        device=device,
    )


def response_logps(model, ids, attn, response_mask, share_prompts=False):
    """Summed and per-token-mean log-probs of the response tokens: (2B,), (2B,). One forward pass.
    share_prompts: each pair's prompt runs once, [prompt, chosen, rejected] in one sequence (exact)."""
    if share_prompts:  # the rows in the rollout's layout: prompts left-padded to P, responses (2B, T)
        query_responses, attention_mask, P, lengths = rows_as_rollout(ids, attn, response_mask)
        mask = attention_mask[:, P:]  # (2B, T)
        logps = forward_logprobs(model, query_responses, attention_mask, P, share_prompts=True, lengths=lengths) * mask
    else:
        mask = response_mask[:, 1:]  # (2B, L-1)
        logps = token_logprobs(model, ids, attn) * mask  # (2B, L-1); the LM head in chunks
    return logps.sum(1), logps.sum(1) / mask.sum(1).clamp(min=1)


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    accelerator = make_accelerator(args.model)  # as launched: DDP, FSDP2, DeepSpeed or TP; --mixed-precision
    device, rank, W = accelerator.device, accelerator.process_index, accelerator.num_processes
    local_batch_size = exact_div(args.batch_size, W, "--batch-size over the number of processes")
    exact_div(local_batch_size, args.micro_batch_size, "--batch-size per process over --micro-batch-size")
    if args.online and args.group_size < 2:
        raise UserError("--online needs --group-size >= 2 to form a pair")
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    configure_deepspeed(
        accelerator, args.micro_batch_size, local_batch_size // args.micro_batch_size, args.optim.max_grad_norm
    )
    seed_everything(args.run.seed)
    log = accelerator.print
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads

    max_len = args.max_prompt_length + max(args.max_completion_length, args.gen.max_new_tokens)
    tok = chat.prompt_tokenizer(args.model, args.data, max_len, "--max-prompt-length + --max-completion-length")
    policy = M.load_causal_lm(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    # with LoRA: the policy with its adapter disabled
    ref_policy = frozen_reference(accelerator, args.model, tok) if not args.model.lora_r else None

    train_files, val_files, eval_prompt_files = args.data.train_files, args.data.val_files, args.eval_prompt_files
    if train_files is None:
        task = args.data.task
        train_files = [default_task_files(task)[0]] if args.online else [default_preference_files(task)[0]]
        val_files = val_files or [default_preference_files(task)[1]]
        eval_prompt_files = eval_prompt_files or [default_task_files(task)[1]]
    reward = None
    if args.online:  # rules, a reward model (its own tokenizer), weighted mixes
        reward = reward_from_args(args.rewards, args.model, args.gen.max_new_tokens, accelerator)
        train_rows = load_prompts(train_files, tok, max_prompt_length=args.max_prompt_length, log=log)
        reward.check({r.data_source for r in train_rows})
    else:
        train_rows = load_preferences(train_files, tok, log=log)
    first = train_rows[0].text if args.online else train_rows[0]["prompt"]
    log(f"[prompt] the first training prompt as the model sees it:\n{first}")
    val_pairs = load_preferences(val_files, tok, log=log)[: args.num_eval_pairs] if val_files else []
    eval_prompts = (
        load_prompts(eval_prompt_files, tok, max_prompt_length=args.max_prompt_length, log=log)[: args.num_eval_prompts]
        if eval_prompt_files
        else []
    )
    rw = args.rewards
    eval_reward = reward or (
        Reward(rw.reward, rw.reward_fn, max_new_tokens=args.gen.max_new_tokens, reward_weights=rw.reward_weights)
        if eval_prompts
        else None
    )
    if eval_prompts:
        eval_reward.check({r.data_source for r in eval_prompts})
    sampler = Sampler(len(train_rows), args.run.seed)
    opt, sched = adamw(policy, args.optim, args.run.total_steps)
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=policy)  # resumed: the checkpoint's weights
    policy, opt, sched = accelerator.prepare(policy, opt, sched)
    # --rollout-engine vllm: the colocated engine; hf: None
    engine = make_engine(args.gen, args.model, tok, policy, accelerator, max_len, args.run.seed)
    share = args.share_prompts and can_share_prompts(policy)  # a pair's prompt once (common.core.forwards)

    @torch.no_grad()
    def ref_logps(ids, attn, response_mask):
        if ref_policy is not None:
            with accelerator.autocast():  # a frozen model is not prepared: --mixed-precision applied here
                return response_logps(ref_policy, ids, attn, response_mask, share)
        with accelerator.unwrap_model(policy).disable_adapter():
            return response_logps(policy, ids, attn, response_mask, share)

    ref_cache = {}  # pair index -> (summed, mean) reference log-probs of (chosen, rejected)
    if args.precompute_ref and not args.online:
        t0 = time.time()
        for i in range(0, len(train_rows), args.micro_batch_size):
            chunk = train_rows[i : i + args.micro_batch_size]
            ref_sums, ref_means = ref_logps(
                *encode_pairs(tok, chunk, args.max_prompt_length, args.max_completion_length, device)
            )
            for j in range(len(chunk)):
                ref_cache[i + j] = (ref_sums[j], ref_sums[len(chunk) + j], ref_means[j], ref_means[len(chunk) + j])
        log(f"reference log-probs of {len(train_rows)} pairs precomputed in {time.time() - t0:.1f}s")

    def pair_stats(pairs, ids_for_cache=None):
        """Forward chosen+rejected in one pass; loss terms and implicit rewards per pair."""
        ids, attn, response_mask = encode_pairs(tok, pairs, args.max_prompt_length, args.max_completion_length, device)
        sums, means = response_logps(policy, ids, attn, response_mask, share)  # (2b,) each
        b = len(pairs)
        if ids_for_cache is not None and ref_cache:
            ref = torch.stack([torch.stack(ref_cache[i]) for i in ids_for_cache])  # (b, 4)
            ref_sum_c, ref_sum_r, ref_mean_c, ref_mean_r = ref.unbind(1)
        else:
            ref_sums, ref_means = ref_logps(ids, attn, response_mask)
            ref_sum_c, ref_sum_r, ref_mean_c, ref_mean_r = ref_sums[:b], ref_sums[b:], ref_means[:b], ref_means[b:]
        if args.loss_type == "ipo":  # IPO on length-normalised (per-token mean) log-ratios, as TRL does
            losses = dpo_loss(means[:b], means[b:], ref_mean_c, ref_mean_r, "ipo", args.beta)
        else:
            losses = dpo_loss(sums[:b], sums[b:], ref_sum_c, ref_sum_r, args.loss_type, args.beta, args.label_smoothing)
        chosen_r, rejected_r = args.beta * (sums[:b] - ref_sum_c).detach(), args.beta * (sums[b:] - ref_sum_r).detach()
        nll = -means[:b]  # per-token NLL of chosen (RPO's SFT term)
        return losses, nll, chosen_r, rejected_r, sums[:b].detach(), sums[b:].detach()

    @torch.no_grad()
    def evaluate():
        metrics = {}
        if val_pairs:
            local = val_pairs[rank::W][: max(len(val_pairs) // W, 1)]  # the same number on every process
            acc, margin, loss = [], [], []
            for i in range(0, len(local), args.micro_batch_size):
                l, _, c, r, _, _ = pair_stats(local[i : i + args.micro_batch_size])
                acc.append((c > r).float()), margin.append(c - r), loss.append(l)
            metrics["eval/rewards_accuracy"] = accelerator.gather(torch.cat(acc)).mean().item()
            metrics["eval/rewards_margin"] = accelerator.gather(torch.cat(margin)).mean().item()
            metrics["eval/loss"] = accelerator.gather(torch.cat(loss)).mean().item()
        if eval_prompts:
            T_max = args.gen.max_new_tokens
            m, _ = evaluate_policy(
                accelerator, policy, tok, eval_reward, eval_prompts, T_max, args.micro_batch_size, engine
            )
            metrics.update(m)
        return metrics

    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    state = dict(sched=sched, sampler=sampler, guard=guard)
    run.begin(
        tok, {"policy": policy}, {"opt": ("policy", opt)}, state, evaluate if (val_pairs or eval_prompts) else None
    )

    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        ids = sampler.take(args.batch_size)[rank * local_batch_size : (rank + 1) * local_batch_size]  # this rank's
        ties, gen_s = 0, 0.0
        # ------------------------------------------------------------------ 1. pairs (offline, or sampled + ranked)
        if args.online:
            t_gen = time.time()
            rows = [train_rows[i] for i in ids for _ in range(args.group_size)]  # (B*K,) a prompt's samples adjacent
            q, qm = tokenize_queries(tok, [x.text for x in rows], device)
            seeds = [
                mix_seed(args.run.seed, step, rank * local_batch_size * args.group_size + j) for j in range(len(rows))
            ]
            with unwrap_for_generation(accelerator, policy, engine) as gen_model:
                rollout = generate(gen_model, tok, q, qm, **args.gen.sampling(), seeds=seeds, engine=engine)
            texts = tok.batch_decode(rollout.responses, skip_special_tokens=True)
            # the pairs train on the generated ids (EOS only where the policy emitted it), not on re-tokenised text
            response_ids = [
                resp[:n].tolist() for resp, n in zip(rollout.responses, rollout.response_mask.sum(1).long())
            ]
            scores, _, _ = reward(rows, texts, rollout.response_mask.sum(1), device, rollout.is_eos)
            scores = scores.view(-1, args.group_size)  # (B, K)
            pairs, pair_ids = [], []
            for k, i in enumerate(ids):
                best_i, worst_i = scores[k].argmax().item(), scores[k].argmin().item()
                if scores[k, best_i] == scores[k, worst_i]:
                    ties += 1
                    continue
                best, worst = response_ids[k * args.group_size + best_i], response_ids[k * args.group_size + worst_i]
                pairs.append({"prompt": train_rows[i].text, "chosen": best, "rejected": worst})
            pair_ids = None
            filler = {"prompt": rows[0].text, "chosen": response_ids[0], "rejected": response_ids[0]}  # see the update
            gen_s = time.time() - t_gen
        else:
            pairs, pair_ids = [train_rows[i] for i in ids], ids

        # ------------------------------------------------------------------ 2. update
        t_train = time.time()
        stats = {k: [] for k in ("loss", "sft", "chosen", "rejected", "logps_c", "logps_r")}
        # mean over all ranks' pairs (global_mean_divisor). --online skips ties, so ranks can hold different numbers
        # of pairs; every rank still runs the same number of backward passes (DDP and DeepSpeed reduce inside them),
        # a short rank running a filler pair with weight 0
        divisor = global_mean_divisor(torch.tensor(float(len(pairs)), device=device))
        n_micro = int(accelerator.gather(torch.tensor([-(-len(pairs) // args.micro_batch_size)], device=device)).max())
        for j in range(n_micro):
            mp = pairs[j * args.micro_batch_size : (j + 1) * args.micro_batch_size]
            weight = 1.0 if mp else 0.0
            losses, nll, c, rj, lc, lr_ = pair_stats(
                mp or [filler],
                pair_ids[j * args.micro_batch_size : (j + 1) * args.micro_batch_size] if pair_ids else None,
            )
            loss = weight * (losses.sum() + args.sft_coef * nll.sum()) / divisor
            backward(accelerator, policy, loss, last=j == n_micro - 1)
            if mp:
                for key, v in zip(stats, (losses, nll, c, rj, lc, lr_)):
                    stats[key].append(v.detach())
        if n_micro > 0:  # some rank has a pair
            guard.step(policy, opt, args.optim.max_grad_norm, "policy", step)
        sched.step()
        opt.zero_grad()
        train_s = time.time() - t_train

        # ------------------------------------------------------------------ 3. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
            # pairs per rank differ when --online skips ties: gather padded values with a validity flag
            def gmean(key):
                x = torch.cat(stats[key]) if stats[key] else torch.zeros(0, device=device)
                x = F.pad(x, (0, local_batch_size - len(x)), value=float("nan"))
                x = accelerator.gather(x)
                x = x[~torch.isnan(x)]
                return x.mean().item() if len(x) else float("nan")

            c_all, r_all = [
                torch.cat(stats[k]) if stats[k] else torch.zeros(0, device=device) for k in ("chosen", "rejected")
            ]
            acc = F.pad((c_all > r_all).float(), (0, local_batch_size - len(c_all)), value=float("nan"))
            acc = accelerator.gather(acc)
            step_s = time.time() - t_step
            metrics = {
                "loss/policy": gmean("loss"),
                "loss/sft": gmean("sft"),
                "rewards/chosen": gmean("chosen"),
                "rewards/rejected": gmean("rejected"),
                "rewards/accuracy": acc[~torch.isnan(acc)].mean().item() if (~torch.isnan(acc)).any() else float("nan"),
                "rewards/margin": gmean("chosen") - gmean("rejected"),
                "train/logps_chosen": gmean("logps_c"),
                "train/logps_rejected": gmean("logps_r"),
                "train/lr": sched.get_last_lr()[0],
                "train/pairs": accelerator.reduce(torch.tensor(float(len(pairs)), device=device), "sum").item(),
                "perf/step_s": step_s,
                **engine_perf(engine),
                "perf/gen_s": gen_s,
                "perf/train_s": train_s,
                "perf/peak_mem_gb": peak_mem_gb(device),
            }
            if args.online:
                metrics["train/skipped_ties"] = accelerator.reduce(
                    torch.tensor(float(ties), device=device), "sum"
                ).item()
                metrics["train/reward"] = accelerator.gather(scores.mean(1)).mean().item()
            metrics = {k: v for k, v in metrics.items() if v == v}  # no pairs this step (all tied): no pair metrics
            metrics["train/skipped_steps"] = guard.skipped

            def as_text(c):  # --online: token ids
                return c if isinstance(c, str) else tok.decode(c, skip_special_tokens=True)

            samples = [
                {"prompt": p["prompt"], "chosen": as_text(p["chosen"]), "rejected": as_text(p["rejected"])}
                for p in pairs[: args.run.num_samples_logged]
            ]
            run.log(step, metrics, samples)  # + evaluation when due, --save-best

    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = (
    "--model-name-or-path {tiny} --batch-size 4 --micro-batch-size 2 --num-eval-pairs 4 --num-eval-prompts 4 "
    "--max-new-tokens 6"
)


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
