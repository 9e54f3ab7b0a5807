"""Reward model training (Bradley-Terry) on preference pairs.

Docs: docs/algos/rm.md. Ziegler et al. 2019, Stiennon et al. 2020, Ouyang et al. 2022: a causal-LM
body with a scalar head (`AutoModelForSequenceClassification`, one label) read at the last real
token; loss -log sigmoid(r(chosen) - r(rejected)).

After training, the reward is normalised as in Ziegler et al.: gain and bias are set so the scores
of a reference sample (the chosen and rejected responses of `--num-norm-samples` training pairs)
have mean 0 and std 1. They are stored in the saved config as `reward_gain` / `reward_bias`
(the Llama head has no bias to fold them into); cleanrlhf's reward loader applies
`gain * raw + bias`, plain transformers returns the raw score. The saved folder works directly as
`--reward-model` for ppo_llm.py, grpo_llm.py and dpo_llm.py --online.

    python algos/rm_llm.py                                    # SmolLM2-135M-Instruct on built-in chain_sum_1d pairs
    python algos/rm_llm.py --train-files pairs.parquet --val-files pairs_test.parquet
    python algos/ppo_llm.py --reward-model runs/rm_llm__.../reward_model --reward "model:1.0"

Legend: B pairs per rank, L prompt + response length.
"""

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

import torch
import torch.nn.functional as F

from common import models as M
from common.cli import cli
from common.data import Sampler, encode_prompt_response, load_preferences
from common.distributed import (
    UpdateGuard,
    backward,
    configure_deepspeed,
    full_tensors,
    make_accelerator,
    reshard,
    saved_by_one_process,
)
from common.errors import seed_everything
from common.ops import exact_div
from common.perf import peak_mem_gb
from common.rollout import position_ids_from_mask
from common.run import Run
from common.tasks import default_preference_files


@dataclass
class Args:
    # --- experiment
    exp_name: str = Path(__file__).stem
    """name of this experiment (W&B group; part of the run folder name)"""
    seed: int = 1
    """seed of model init and pair order"""
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
    """body: hub id, local folder, or the offline default alias (a new one-output head is added)"""
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
    """LoRA rank (0 = full fine-tuning); the head always trains"""
    lora_alpha: int = 32
    """LoRA alpha"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""

    # --- data
    train_files: Optional[list[str]] = None
    """preference files (prompt, chosen, rejected); default: built-in task answer pairs"""
    val_files: Optional[list[str]] = None
    """held-out preference files (default: the built-in task's test pairs)"""
    task: str = "chain_sum_1d"
    """built-in reasoning-gym task used when no files are given"""
    apply_chat_template: bool = True
    """render prompts with the tokenizer's chat template (--no-apply-chat-template: raw text, for base models)"""
    chat_template_kwargs: Optional[str] = None
    """JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'"""
    system_prompt: Optional[str] = None
    """system message put first in every prompt (default: none beyond what the chat template adds)"""
    max_length: int = 512
    """tokens per prompt + response (the prompt's start is cut first)"""
    num_eval_pairs: int = 256
    """held-out pairs per evaluation"""
    num_norm_samples: int = 256
    """training pairs whose chosen and rejected scores set the normalisation (mean 0, std 1)"""

    # --- optimisation
    total_steps: int = 200
    """optimizer steps"""
    batch_size: int = 16
    """pairs per optimizer step, over all processes"""
    micro_batch_size: int = 8
    """pairs per forward/backward on one process"""
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


# ALGO LOGIC: Bradley-Terry
def scores_of(model, tok, pairs, max_length, device):
    """Raw scores of chosen and rejected, one forward pass: (B,), (B,). Each sequence is
    prompt + response + EOS (the shared encoder, which the RL reward scorer uses too); the head
    reads the last non-pad token, i.e. EOS (transformers finds it from pad_token_id, which is not EOS)."""
    ids, attn, _ = encode_prompt_response(
        tok,
        [p["prompt"] for p in pairs] * 2,
        [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
        eos=True,
        max_length=max_length,
        device=device,
    )  # (2B, L)
    s = (
        model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, 0].float()
    )  # (2B,)
    return s[: len(pairs)], s[len(pairs) :]


def bt_loss(chosen, rejected):
    """Bradley-Terry: -log sigmoid(r_c - r_r), per pair."""
    return -F.logsigmoid(chosen - rejected)


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
    lora = (
        dict(
            lora_r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_dropout=0.0,
            lora_target="all-linear",
            gradient_checkpointing=args.gradient_checkpointing,
            load_in_4bit=False,
        )
        if args.lora_r
        else {}
    )
    model = M.load_reward_model(args.model_name_or_path, tok, args.dtype, args.trust_remote_code, **lora)
    train_files, val_files = args.train_files, args.val_files
    if train_files is None:
        train_files, default_val = default_preference_files(args.task)
        val_files = val_files or [default_val]
    train_pairs = load_preferences(train_files, tok, log=log)
    log(f"[prompt] the first training prompt as the model sees it:\n{train_pairs[0]['prompt']}")
    val_pairs = load_preferences(val_files, tok, log=log)[: args.num_eval_pairs] if val_files else []
    sampler = Sampler(len(train_pairs), args.seed)

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
    run.load_weights(model=model)  # resumed: the checkpoint's weights
    model, opt, sched = accelerator.prepare(model, opt, sched)

    @torch.no_grad()
    def score_pairs(pairs):
        """Global (chosen, rejected) scores of `pairs`, split over processes."""
        world = accelerator.num_processes
        pairs = pairs[: max(len(pairs) // world, 1) * world]
        local = pairs[accelerator.process_index :: world]
        cs, rs = zip(
            *[
                scores_of(model, tok, local[i : i + args.micro_batch_size], args.max_length, device)
                for i in range(0, len(local), args.micro_batch_size)
            ]
        )
        return accelerator.gather(torch.cat(cs)), accelerator.gather(torch.cat(rs))

    def evaluate():
        if not val_pairs:
            return {}
        chosen, rejected = score_pairs(val_pairs)
        return {
            "eval/rm_accuracy": (chosen > rejected).float().mean().item(),
            "eval/rm_margin": (chosen - rejected).mean().item(),
            "eval/loss": bt_loss(chosen, rejected).mean().item(),
        }

    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    run.begin(
        tok,
        models={"model": model},
        optimizers={"opt": ("model", opt)},
        state=dict(sched=sched, sampler=sampler, guard=guard),
        evaluate=evaluate,
    )
    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. batch: this rank's slice of the pairs
        rank = accelerator.process_index
        global_ids = sampler.take(args.batch_size)
        batch = [train_pairs[i] for i in global_ids[rank * args.local_batch_size : (rank + 1) * args.local_batch_size]]
        # ------------------------------------------------------------------ 2. update (mean over the batch)
        stats = {"loss": [], "chosen": [], "rejected": []}
        for k in range(0, len(batch), args.micro_batch_size):
            chosen, rejected = scores_of(model, tok, batch[k : k + args.micro_batch_size], args.max_length, device)
            loss = bt_loss(chosen, rejected)
            backward(accelerator, model, loss.sum() / len(batch), last=k + args.micro_batch_size >= len(batch))
            for key, v in zip(stats, (loss, chosen, rejected)):
                stats[key].append(v.detach())
        guard.step(model, opt, args.max_grad_norm, "reward model", step)
        sched.step()
        opt.zero_grad()
        # ------------------------------------------------------------------ 3. log, evaluate, checkpoint
        if run.logging(step):  # --log-every, and every evaluation step and the last
            chosen, rejected = (accelerator.gather(torch.cat(stats[k])) for k in ("chosen", "rejected"))
            metrics = {
                "loss/rm": bt_loss(chosen, rejected).mean().item(),
                "rm/accuracy": (chosen > rejected).float().mean().item(),
                "rm/margin": (chosen - rejected).mean().item(),
                "train/lr": sched.get_last_lr()[0],
                "perf/step_s": time.time() - t_step,
                "perf/peak_mem_gb": peak_mem_gb(device),
            }
            metrics["train/skipped_steps"] = guard.skipped
            run.log(step, metrics)  # + evaluation when due, --save-best

    # ------------------------------------------------------------------ normalise and save the reward model
    chosen, rejected = score_pairs(train_pairs[: args.num_norm_samples])
    ref = torch.cat([chosen, rejected])  # the reference sample's raw scores
    gain = 1.0 / ref.std().clamp(min=1e-6).item()
    bias = -ref.mean().item() * gain
    reshard(model)  # FSDP2: scoring was a no_grad forward; see common.distributed.reshard
    state_dict = full_tensors(accelerator.get_state_dict(model))  # full weights, gathered under FSDP2 / ZeRO-3 / TP
    unwrapped = accelerator.unwrap_model(model)
    if args.lora_r:  # LoRA: merged into the weights, since --reward-model expects a plain folder
        state_dict = (
            M.merge_lora_state_dict(state_dict, args.lora_alpha / args.lora_r) if accelerator.is_main_process else None
        )
        unwrapped = unwrapped.get_base_model()
    unwrapped.config.reward_gain, unwrapped.config.reward_bias = gain, bias
    unwrapped.config.reward_max_length = args.max_length  # the RL scorer truncates as training did
    if accelerator.is_main_process:
        with saved_by_one_process(unwrapped):  # under --tp-size: see common.distributed
            unwrapped.save_pretrained(run.dir / "reward_model", state_dict=state_dict)
        tok.save_pretrained(run.dir / "reward_model")
        norm = ref * gain + bias
        run.tracker.log(
            args.total_steps,
            {
                "rm/norm_gain": gain,
                "rm/norm_bias": bias,
                "rm/norm_mean": norm.mean().item(),
                "rm/norm_std": norm.std().item(),
            },
        )
    log(f"reward model: {run.dir / 'reward_model'} (gain {gain:.4g}, bias {bias:.4g})")
    return run.end()


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
