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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

# fmt: off
import torch
import torch.nn.functional as F

from common.core import chat
from common.core.data import Sampler, encode_prompt_response, load_preferences
from common.core.generation import position_ids_from_mask
from common.core import models as M
from common.core.ops import exact_div
from common.core.tasks import default_preference_files
from common.core.seeds import seed_everything
from common.parallel.accelerator import configure_deepspeed, full_tensors, make_accelerator, saved_by_one_process
from common.parallel.optim import adamw
from common.parallel.sharded import UpdateGuard, backward, reshard
from common.harness.args import DataArgs, Group, ModelArgs, NonNegInt, OptimArgs, PositiveInt, RunArgs, group
from common.harness.cli import cli
from common.harness.perf import peak_mem_gb
from common.harness.run import Run
# fmt: on


@dataclass
class Args:
    # --- algorithm
    batch_size: PositiveInt = 16
    """pairs per optimizer step, over all processes"""
    max_length: PositiveInt = 512
    """tokens per prompt + response (the prompt's start is cut first)"""
    num_norm_samples: PositiveInt = 256
    """training pairs whose chosen and rejected scores set the normalisation (mean 0, std 1)"""
    num_eval_pairs: NonNegInt = 256
    """held-out pairs per evaluation"""
    # --- memory
    micro_batch_size: PositiveInt = 8
    """pairs per forward/backward on one process"""

    # --- the flags every script shares (common/harness/args.py), flat: --seed, --model-name-or-path, --train-files, ...
    run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=200, eval_every=50)
    model: Group[ModelArgs] = group(ModelArgs)
    """the body (a new one-output head is added): weights, precision, LoRA, parallelism"""
    data: Group[DataArgs] = group(DataArgs)
    """preference files (prompt, chosen, rejected); default: the built-in task's answer pairs"""
    optim: Group[OptimArgs] = group(OptimArgs, learning_rate=1e-5, lr_scheduler="cosine", warmup_steps=10)


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
    model = M.load_reward_model(args.model.model_name_or_path, tok, **M.train_kwargs(args.model))
    train_files, val_files = args.data.train_files, args.data.val_files
    if train_files is None:
        train_files, default_val = default_preference_files(args.data.task)
        val_files = val_files or [default_val]
    train_pairs = load_preferences(train_files, tok, log=log)
    log(f"[prompt] the first training prompt as the model sees it:\n{train_pairs[0]['prompt']}")
    val_pairs = load_preferences(val_files, tok, log=log)[: args.num_eval_pairs] if val_files else []
    sampler = Sampler(len(train_pairs), args.run.seed)
    opt, sched = adamw(model, args.optim, args.run.total_steps)
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
    state = dict(sched=sched, sampler=sampler, guard=guard)
    run.begin(tok, {"model": model}, {"opt": ("model", opt)}, state, evaluate=evaluate)
    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. batch: this rank's slice of the pairs
        rank = accelerator.process_index
        ids = sampler.take(args.batch_size)[rank * local_batch_size : (rank + 1) * local_batch_size]  # this rank's
        batch = [train_pairs[i] for i in ids]
        # ------------------------------------------------------------------ 2. update (mean over the batch)
        stats = {"loss": [], "chosen": [], "rejected": []}
        for k in range(0, len(batch), args.micro_batch_size):
            chosen, rejected = scores_of(model, tok, batch[k : k + args.micro_batch_size], args.max_length, device)
            loss = bt_loss(chosen, rejected)
            backward(accelerator, model, loss.sum() / len(batch), last=k + args.micro_batch_size >= len(batch))
            for key, v in zip(stats, (loss, chosen, rejected)):
                stats[key].append(v.detach())
        guard.step(model, opt, args.optim.max_grad_norm, "reward model", step)
        sched.step()
        opt.zero_grad()
        # ------------------------------------------------------------------ 3. log, evaluate, checkpoint
        if run.should_log(step):  # --log-every, and every evaluation step and the last
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
    reshard(model)  # FSDP2: scoring was a no_grad forward; see common.parallel.sharded.reshard
    state_dict = full_tensors(accelerator.get_state_dict(model))  # full weights, gathered under FSDP2 / ZeRO-3 / TP
    unwrapped = accelerator.unwrap_model(model)
    if args.model.lora_r:  # LoRA: merged into the weights, since --reward-model expects a plain folder
        state_dict = (
            M.merge_lora_state_dict(state_dict, args.model.lora_alpha / args.model.lora_r)
            if accelerator.is_main_process
            else None
        )
        unwrapped = unwrapped.get_base_model()
    unwrapped.config.reward_gain, unwrapped.config.reward_bias = gain, bias
    unwrapped.config.reward_max_length = args.max_length  # the RL scorer truncates as training did
    unwrapped.config.reward_prompt_format = chat.prompt_format(tok)  # and renders prompts as they were here
    if accelerator.is_main_process:
        with saved_by_one_process(unwrapped):  # under --tp-size: see common.parallel.accelerator
            unwrapped.save_pretrained(run.dir / "reward_model", state_dict=state_dict)
        tok.save_pretrained(run.dir / "reward_model")
        norm = ref * gain + bias
        run.tracker.log(
            args.run.total_steps,
            {
                "rm/norm_gain": gain,
                "rm/norm_bias": bias,
                "rm/norm_mean": norm.mean().item(),
                "rm/norm_std": norm.std().item(),
            },
        )
    log(f"reward model: {run.dir / 'reward_model'} (gain {gain:.4g}, bias {bias:.4g})")
    return run.end()


# a two-step run on a tiny model, as tests/scripts/test_smoke.py runs every script (and every copy) in algos/
SMOKE = "--model-name-or-path {tiny} --batch-size 4 --micro-batch-size 2 --num-eval-pairs 4 --num-norm-samples 4"


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
