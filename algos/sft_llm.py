"""Supervised fine-tuning (warm start): next-token loss on the assistant tokens of chat examples.

Docs: docs/algos/sft.md. The first stage of the classic RLHF pipeline (SFT -> reward model -> PPO;
Ouyang et al. 2022), and of tool use (docs/agents.md: demonstrations -> SFT -> GRPO --env tools). Data:
`messages` (a whole conversation: every assistant turn is a target; tool results, user and system
messages are context, rendered exactly as a multi-turn rollout renders them) or `prompt` + `response`;
the loss covers the assistant's tokens and their EOS only.

    python algos/sft_llm.py                                   # SmolLM2-135M-Instruct on the built-in chain_sum_1d SFT
    set python algos/sft_llm.py --train-files data/chain_sum_1d/sft_train.parquet --lora-r 16 python algos/ppo_llm.py
    --model-name-or-path runs/sft_llm__.../checkpoints/step_200/policy   # then RL accelerate launch algos/sft_llm.py

Packing is not offered: several examples in one row would attend to each other with the SDPA
attention used on CPUs and most setups; keeping them apart needs flash-attention's variable-length
kernels (GPU only). Rows are right-padded to the longest in each micro-batch instead.

Legend: B examples per rank, L prompt + response length, V vocabulary.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch

from common.core import chat
from common.core.data import Sampler, load_prompts, load_sft
from common.core.forwards import token_logprobs
from common.core import models as M
from common.core.ops import exact_div, global_mean_divisor
from common.core.rewards import Reward
from common.core.tasks import default_sft_files, default_task_files
from common.core.seeds import seed_everything
from common.parallel.accelerator import configure_deepspeed, make_accelerator
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward
from common.harness.args import DataArgs, Group, ModelArgs, NonNegInt, OptimArgs, PositiveInt, RunArgs, group
from common.harness.cli import cli
from common.harness.eval import evaluate_policy
from common.harness.perf import peak_mem_gb
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    batch_size: PositiveInt = 16
    """examples per optimizer step, over all processes"""
    max_length: PositiveInt = 512
    """tokens per example (prompt + response); longer examples keep the response and cut the prompt's start"""
    # --- evaluation
    eval_prompt_files: Optional[list[str]] = None
    """prompt files (with data_source) for eval/accuracy by greedy decoding (default: built-in task's test split)"""
    num_eval_examples: NonNegInt = 64
    """held-out examples per eval/loss"""
    num_eval_prompts: NonNegInt = 64
    """prompts per greedy evaluation"""
    max_new_tokens: PositiveInt = 64
    """answer length limit in evaluation"""
    # --- memory
    micro_batch_size: PositiveInt = 8
    """examples per forward/backward on one process"""

    # --- the flags every script shares (common/harness/args.py), flat: --seed, --model-name-or-path, --train-files, ...
    run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=200, eval_every=50)
    model: Group[ModelArgs] = group(ModelArgs)
    data: Group[DataArgs] = group(DataArgs)
    """SFT files (messages, or prompt + response); --val-files for eval/loss; default: the built-in task's SFT set"""
    optim: Group[OptimArgs] = group(OptimArgs, learning_rate=1e-5, lr_scheduler="cosine", warmup_steps=10)


# ALGO LOGIC: next-token loss on the assistant's tokens only
def encode_examples(tok, examples, max_length, device):
    """Right-padded conversations (`common.core.data.encode_conversation`'s ids: one-turn or multi-turn, rendered as a
    rollout renders them). Returns input_ids, attention_mask, loss_mask: (B, L). loss_mask is 1 on the assistant
    turns' tokens and their EOS only: system, user and tool messages are context, not targets. Past `max_length`
    the prompt's start is cut (never beyond the first assistant token), then the end."""
    seqs = []
    for ex in examples:
        ids, m = ex["ids"], ex["loss_mask"]
        cut = min(max(0, len(ids) - max_length), m.index(1) if 1 in m else 0)
        seqs.append((ids[cut:][:max_length], m[cut:][:max_length]))
    L = max(len(x) for x, _ in seqs)
    ids = torch.tensor([x + [tok.pad_token_id] * (L - len(x)) for x, _ in seqs], device=device)  # (B, L)
    attn = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x, _ in seqs], device=device)  # (B, L)
    loss_mask = torch.tensor([m + [0] * (L - len(m)) for _, m in seqs], device=device, dtype=torch.float)  # (B, L)
    return ids, attn, loss_mask


def sft_loss_sum(model, ids, attn, loss_mask):
    """Sum of -log p(token) over loss-masked tokens (shifted by one) and their count."""
    nll = -token_logprobs(model, ids, attn) * loss_mask[:, 1:]  # (B, L-1); the LM head in chunks, no (B, L, V) logits
    return nll.sum(), loss_mask[:, 1:].sum()


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    accelerator = make_accelerator(args.model)  # as launched: DDP, FSDP2, DeepSpeed or TP; --mixed-precision
    device = accelerator.device
    local_batch_size = exact_div(
        args.batch_size, accelerator.num_processes, "--batch-size over the number of processes"
    )
    exact_div(local_batch_size, args.micro_batch_size, "--batch-size per process over --micro-batch-size")
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    configure_deepspeed(
        accelerator, args.micro_batch_size, local_batch_size // args.micro_batch_size, args.optim.max_grad_norm
    )
    seed_everything(args.run.seed)
    log = accelerator.print
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads

    tok = chat.prompt_tokenizer(args.model, args.data, args.max_length, "--max-length")
    model = M.load_causal_lm(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    train_files, val_files, eval_prompt_files = args.data.train_files, args.data.val_files, args.eval_prompt_files
    if train_files is None:
        train_files, default_val = default_sft_files(args.data.task)
        val_files = val_files or [default_val]
        eval_prompt_files = eval_prompt_files or [default_task_files(args.data.task)[1]]
    train_rows = load_sft(train_files, tok)
    log(f"[prompt] the first training prompt as the model sees it:\n{train_rows[0]['prompt']}")
    val_rows = load_sft(val_files, tok)[: args.num_eval_examples] if val_files else []
    eval_prompts = (
        load_prompts(eval_prompt_files, tok, max_prompt_length=args.max_length, log=log)[: args.num_eval_prompts]
        if eval_prompt_files
        else []
    )
    reward = Reward("rule:1.0", max_new_tokens=args.max_new_tokens)
    if eval_prompts:
        reward.check({r.data_source for r in eval_prompts})
    sampler = Sampler(len(train_rows), args.run.seed)
    opt, sched = adamw(model, args.optim, args.run.total_steps)
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=model)  # resumed: the checkpoint's weights
    model, opt, sched = accelerator.prepare(model, opt, sched)

    @torch.no_grad()
    def evaluate():
        metrics = {}
        if val_rows:
            local = val_rows[accelerator.process_index :: accelerator.num_processes]
            tot = torch.zeros(2, device=device)
            for i in range(0, len(local), args.micro_batch_size):
                s, n = sft_loss_sum(
                    model, *encode_examples(tok, local[i : i + args.micro_batch_size], args.max_length, device)
                )
                tot += torch.stack([s, n])
            tot = accelerator.reduce(tot, "sum")
            metrics["eval/loss"] = (tot[0] / tot[1].clamp(min=1)).item()
        if eval_prompts:
            m, _ = evaluate_policy(
                accelerator, model, tok, reward, eval_prompts, args.max_new_tokens, args.micro_batch_size
            )
            metrics.update(m)
        return metrics

    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    state = dict(sched=sched, sampler=sampler, guard=guard)
    run.begin(tok, {"policy": model}, {"opt": ("policy", opt)}, state, evaluate=evaluate)
    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. batch: this rank's slice of the examples
        rank = accelerator.process_index
        ids = sampler.take(args.batch_size)[rank * local_batch_size : (rank + 1) * local_batch_size]  # this rank's
        batch = [train_rows[i] for i in ids]
        # ------------------------------------------------------------------ 2. update: token-mean over the
        # whole global batch, so count its loss tokens first
        encoded = [
            encode_examples(tok, batch[k : k + args.micro_batch_size], args.max_length, device)
            for k in range(0, len(batch), args.micro_batch_size)
        ]
        n_local = sum(e[2][:, 1:].sum() for e in encoded)
        divisor = global_mean_divisor(n_local)
        total = torch.zeros((), device=device)
        for j, (ids, attn, loss_mask) in enumerate(encoded):
            s, _ = sft_loss_sum(model, ids, attn, loss_mask)
            backward(accelerator, model, s / divisor, last=j == len(encoded) - 1)
            total += s.detach()
        grad_norm = guard.step(
            model, opt, args.optim.max_grad_norm, "policy", step
        )  # clip; skip the step if non-finite
        sched.step()
        opt.zero_grad()
        # ------------------------------------------------------------------ 3. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
            step_s = time.time() - t_step
            n_global = accelerator.reduce(n_local.clone(), "sum")
            metrics = {
                "loss/sft": (accelerator.reduce(total, "sum") / n_global).item(),
                "train/lr": sched.get_last_lr()[0],
                "train/grad_norm": float(grad_norm),
                "train/tokens": n_global.item(),
                "perf/step_s": step_s,
                "perf/tokens_per_s": n_global.item() / step_s,
                "perf/peak_mem_gb": peak_mem_gb(device),
            }
            metrics["train/skipped_steps"] = guard.skipped
            run.log(step, metrics)  # + evaluation when due, --save-best

    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = (
    "--model-name-or-path {tiny} --batch-size 4 --micro-batch-size 2 --num-eval-examples 4 --num-eval-prompts "
    "4 --max-new-tokens 6"
)


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
