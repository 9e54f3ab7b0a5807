"""Supervised fine-tuning (warm start): next-token loss on the response tokens of chat examples.

Docs: docs/algos/sft.md. The first stage of the classic RLHF pipeline (SFT -> reward model -> PPO;
Ouyang et al. 2022). Data: `messages` (the last assistant turn is the response) or `prompt` +
`response`; the loss covers the response and its EOS only, never the prompt.

    python algos/sft_llm.py                                   # SmolLM2-135M-Instruct on the built-in chain_sum_1d SFT set
    python algos/sft_llm.py --train-files data/chain_sum_1d/sft_train.parquet --lora-r 16
    python algos/ppo_llm.py --model-name-or-path runs/sft_llm__.../checkpoints/step_200/policy   # then RL
    accelerate launch algos/sft_llm.py

Packing is not offered: several examples in one row would attend to each other with the SDPA
attention used on CPUs and most setups; keeping them apart needs flash-attention's variable-length
kernels (GPU only). Rows are right-padded to the longest in each micro-batch instead.

Legend: B examples per rank, L prompt + response length, V vocabulary.
"""

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

import torch

from common import models as M
from common.cli import cli
from common.data import Sampler, encode_prompt_response, load_prompts, load_sft
from common.distributed import UpdateGuard, backward, configure_deepspeed, make_accelerator
from common.errors import seed_everything
from common.eval import evaluate_policy
from common.ops import exact_div, global_mean_divisor, selective_log_softmax
from common.parallel import sharded_logits
from common.perf import peak_mem_gb
from common.rewards import Reward
from common.run import Run
from common.tasks import default_sft_files, default_task_files


@dataclass
class Args:
    # --- experiment
    exp_name: str = Path(__file__).stem
    """name of this experiment (W&B group; part of the run folder name)"""
    seed: int = 1
    """seed of model init and example order"""
    track: bool = False
    """log to Weights & Biases (works with WANDB_MODE=offline)"""
    wandb_project_name: str = "cleanrlhf"
    """W&B project"""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user)"""
    config: Optional[str] = None
    """YAML preset (keys = these field names); CLI flags override it"""
    output_dir: str = "runs"
    """where run folders are created"""
    resume: Optional[str] = None
    """checkpoint folder or run folder (its latest checkpoint) to continue exactly, in that run's folder; 'auto': the latest run of this exp_name/seed if any"""
    save_every: int = 0
    """save a checkpoint every N steps (0: only at the end)"""
    save_every_minutes: float = 30.0
    """also save when this many minutes have passed since the last save (0: off), so a pre-empted run loses little"""
    max_wall_minutes: float = 0.0
    """stop after the step that passes this many minutes of wall time since setup ended (checkpoint and final
    evaluation as at --total-steps), so recipes compare at equal cost; 0: no limit"""
    keep_last: int = 0
    """keep only the last K checkpoints (0: keep all)"""
    save_merged: bool = False
    """LoRA: each checkpoint also holds {model}_merged/, the full merged model (loads without peft: vLLM, TGI)"""
    save_best: Optional[str] = None
    """keep checkpoints/best/, the checkpoint of the best value so far of this metric (e.g. eval/accuracy; losses: lowest)"""
    eval_every: int = 50
    """evaluate every N steps (and before the first and after the last; 0: never)"""
    log_every: int = 1
    """write metrics every N steps"""

    # --- model
    model_name_or_path: str = M.DEFAULT_MODEL
    """model: hub id, local folder, or the offline default alias"""
    trust_remote_code: bool = False
    """allow model code from the hub"""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """weights dtype (auto: float32 on CPU, bfloat16 on GPUs that support it)"""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """bf16: autocast forward/backward in bfloat16 (float32 weights, optimizer, log-softmax); auto: bf16 where it
    pays (float32 weights, a CPU with native bf16 matmul, hidden size >= 256: docs/performance.md), else as
    `accelerate launch --mixed_precision` says; no: float32"""
    tp_size: int = 1
    """tensor parallelism: each model sharded over groups of this many processes (launch tp_size x data-parallel
    processes with torchrun / accelerate launch; batch flags count data-parallel ranks): docs/distributed.md"""
    lora_r: int = 0
    """LoRA rank (0 = full fine-tuning)"""
    lora_alpha: int = 32
    """LoRA alpha"""
    load_in_4bit: bool = False
    """QLoRA: 4-bit base weights (needs CUDA and --lora-r > 0)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""

    # --- data
    train_files: Optional[list[str]] = None
    """SFT files (messages, or prompt + response); default: the built-in task's SFT set"""
    val_files: Optional[list[str]] = None
    """held-out SFT files for eval/loss (default: the built-in task's SFT test set)"""
    eval_prompt_files: Optional[list[str]] = None
    """prompt files (with data_source) for eval/accuracy by greedy decoding (default: built-in task's test split)"""
    task: str = "chain_sum_1d"
    """built-in reasoning-gym task used when no files are given"""
    apply_chat_template: bool = True
    """render prompts with the tokenizer's chat template (--no-apply-chat-template: raw text, for base models)"""
    chat_template_kwargs: Optional[str] = None
    """JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'"""
    system_prompt: Optional[str] = None
    """system message put first in every prompt (default: none beyond what the chat template adds)"""
    max_length: int = 512
    """tokens per example (prompt + response); longer examples keep the response and cut the prompt's start"""
    num_eval_examples: int = 64
    """held-out examples per eval/loss"""
    num_eval_prompts: int = 64
    """prompts per greedy evaluation"""
    max_new_tokens: int = 64
    """answer length limit in evaluation"""

    # --- optimisation
    total_steps: int = 200
    """optimizer steps"""
    batch_size: int = 16
    """examples per optimizer step, over all processes"""
    micro_batch_size: int = 8
    """examples per forward/backward on one process"""
    learning_rate: float = 1e-5
    """learning rate"""
    lr_scheduler: str = "cosine"
    """transformers scheduler name"""
    warmup_steps: int = 10
    """optimizer steps of linear warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""

    # --- filled at runtime
    world_size: int = field(default=1, init=False)
    local_batch_size: int = field(default=0, init=False)


# ALGO LOGIC: response-only next-token loss
def encode_examples(tok, examples, max_length, device):
    """Right-padded prompt+response+EOS (the shared encoder). Returns input_ids, attention_mask,
    loss_mask: (B, L). loss_mask is 1 on response tokens and EOS only: the prompt is context, not a target."""
    return encode_prompt_response(
        tok,
        [ex["prompt"] for ex in examples],
        [ex["response"] for ex in examples],
        eos=True,
        max_length=max_length,
        device=device,
    )


def sft_loss_sum(model, ids, attn, loss_mask):
    """Sum of -log p(token) over loss-masked tokens (shifted by one) and their count."""
    with sharded_logits():  # --tp-size: each rank keeps its block of the vocabulary (common.parallel)
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]  # (B, L-1, V)
        nll = -selective_log_softmax(logits, ids[:, 1:]) * loss_mask[:, 1:]  # (B, L-1)
    return nll.sum(), loss_mask[:, 1:].sum()


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    # as launched: DDP, FSDP2 or DeepSpeed; without GPU, CPU processes over gloo; --mixed-precision
    accelerator = make_accelerator(args.mixed_precision, args.model_name_or_path, args.dtype, args.tp_size)
    device = accelerator.device
    args.world_size = accelerator.num_processes
    args.local_batch_size = exact_div(args.batch_size, args.world_size, "--batch-size over the number of processes")
    exact_div(args.local_batch_size, args.micro_batch_size, "--batch-size per process over --micro-batch-size")
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    configure_deepspeed(
        accelerator, args.micro_batch_size, args.local_batch_size // args.micro_batch_size, args.max_grad_norm
    )
    seed_everything(args.seed)
    log = accelerator.print
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads

    M.check_context(args.model_name_or_path, args.max_length, "--max-length", args.trust_remote_code)
    tok = M.load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    M.set_prompt_format(tok, args.apply_chat_template, args.chat_template_kwargs, args.system_prompt)
    model = M.load_causal_lm(
        args.model_name_or_path,
        tok,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        gradient_checkpointing=args.gradient_checkpointing,
        load_in_4bit=args.load_in_4bit,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )
    train_files, val_files, eval_prompt_files = args.train_files, args.val_files, args.eval_prompt_files
    if train_files is None:
        train_files, default_val = default_sft_files(args.task)
        val_files = val_files or [default_val]
        eval_prompt_files = eval_prompt_files or [default_task_files(args.task)[1]]
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
    sampler = Sampler(len(train_rows), args.seed)

    from transformers import get_scheduler

    # fused: one kernel per step over all parameters (5-9x faster than foreach on CPU: docs/performance.md)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        fused=True,
    )
    sched = get_scheduler(
        args.lr_scheduler, opt, num_warmup_steps=args.warmup_steps, num_training_steps=args.total_steps
    )
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
    run.begin(
        tok,
        models={"policy": model},
        optimizers={"opt": ("policy", opt)},
        state=dict(sched=sched, sampler=sampler, guard=guard),
        evaluate=evaluate,
    )
    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. batch: this rank's slice of the examples
        rank = accelerator.process_index
        global_ids = sampler.take(args.batch_size)
        batch = [train_rows[i] for i in global_ids[rank * args.local_batch_size : (rank + 1) * args.local_batch_size]]
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
        grad_norm = guard.step(model, opt, args.max_grad_norm, "policy", step)  # clip; skip the step if non-finite
        sched.step()
        opt.zero_grad()
        # ------------------------------------------------------------------ 3. log, evaluate, checkpoint
        if run.logging(step):  # --log-every, and every evaluation step and the last
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


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
