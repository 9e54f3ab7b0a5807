"""GRPO: critic-free, group-relative policy optimisation, with flags for its well-known variants.

Docs: docs/algos/grpo.md. Shao et al. 2024 "DeepSeekMath" (GRPO); Liu et al. 2025 "Understanding
R1-Zero-Like Training" (Dr. GRPO); Yu et al. 2025 "DAPO"; Ahmadian et al. 2024 "Back to Basics"
(RLOO).

Each iteration samples `num_prompts` prompts and G = `group_size` responses per prompt. A
response's advantage is its reward relative to the others of its group (no critic, no GAE), the
same for every token of the response. `update_epochs` (mu) passes of a clipped surrogate follow;
an optional KL term to a frozen reference sits in the loss (not in the reward, unlike PPO).
In one line, it reduces to: REINFORCE with a per-prompt baseline, PPO's clipping, and token-level
or sequence-level averaging (the `--loss-agg` flag), which is where most variants differ.

    python algos/grpo_llm.py                                        # SmolLM2-135M-Instruct on chain_sum_1d
    python algos/grpo_llm.py --scale-rewards none --loss-agg seq-mean-token-sum-norm   # Dr. GRPO
    python algos/grpo_llm.py --clip-eps-high 0.28 --dynamic-sampling --loss-agg token-mean \\
        --overlong-buffer 16 --kl-coef 0                                                # DAPO
    python algos/grpo_llm.py --baseline rloo --scale-rewards none                      # RLOO
    accelerate launch --multi_gpu --num_processes 2 algos/grpo_llm.py                 # 2 processes

Legend: N prompts per rank, G samples per prompt, B = N*G sequences, P prompt length, T response length.
        b, t: rows of one micro-batch and its longest response (a micro-batch runs at its own lengths);
        prefixes mb_ (a minibatch: one optimizer step), micro (a micro-batch: one forward/backward).
"""

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so `common` imports from a plain `python algos/...`

import torch
import torch.nn.functional as F
import tyro

from common import models as M
from common.cli import cli
from common.data import Sampler
from common.distributed import (
    UpdateGuard,
    backward,
    configure_deepspeed,
    make_accelerator,
    micro_batch_budget,
    prepare_frozen,
    unwrap_for_generation,
)
from common.errors import UserError, mix_seed, seed_everything
from common.eval import evaluate_policy
from common.health import HealthConfig
from common.ops import all_sum, exact_div, global_mean_divisor, kl_estimate, masked_mean, masked_var
from common.perf import mfu, peak_mem_gb
from common.rewards import reward_from_args
from common.rollout import (
    forward_by_micro_batch,
    forward_logprobs,
    generate,
    micro_batches,
    padding_fraction,
    sequence_attention_mask,
    tokenize_queries,
)
from common.run import Run
from common.tasks import load_rl_prompts
from common.vllm_engine import make_engine


@dataclass
class Args:
    # --- experiment
    exp_name: str = Path(__file__).stem
    """name of this experiment (W&B group; part of the run folder name)"""
    seed: int = 1
    """seed of model init, prompt order, sampling and minibatch shuffling"""
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
    eval_every: int = 10
    """evaluate every N steps (and before the first and after the last; 0: never)"""
    log_every: int = 1
    """write metrics every N steps"""
    num_samples_logged: int = 4
    """rollouts written to samples.jsonl (and a W&B table) per log interval"""

    # --- model
    model_name_or_path: str = M.DEFAULT_MODEL
    """policy: hub id, local folder, or the offline default alias"""
    reward_model: Optional[str] = None
    """sequence-classification reward model (used by a 'model' term in --reward)"""
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
    """LoRA rank (0 = full fine-tuning); the reference is the adapter disabled"""
    lora_alpha: int = 32
    """LoRA alpha"""
    load_in_4bit: bool = False
    """QLoRA: 4-bit base weights (needs CUDA and --lora-r > 0)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""

    # --- data and reward
    train_files: Optional[list[str]] = None
    """prompt files (parquet/jsonl/arrow or hub id); default: the built-in task"""
    val_files: Optional[list[str]] = None
    """validation prompt files; default: the built-in task's test split"""
    task: str = "chain_sum_1d"
    """built-in reasoning-gym task used when no --train-files are given"""
    apply_chat_template: bool = True
    """render prompts with the tokenizer's chat template (--no-apply-chat-template: raw text, for base models)"""
    chat_template_kwargs: Optional[str] = None
    """JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'"""
    system_prompt: Optional[str] = None
    """system message put first in every prompt (default: none beyond what the chat template adds)"""
    prompt_key: str = "prompt"
    """column holding the prompt"""
    reward_fn_key: str = "data_source"
    """column selecting the reward function"""
    max_prompt_length: int = 256
    """prompts longer than this (tokens) are dropped, or cut with --truncate-prompts"""
    truncate_prompts: bool = False
    """keep the last --max-prompt-length tokens of long prompts instead of dropping them"""
    reward: str = "rule:1.0"
    """weighted reward sources, e.g. 'rule:1.0,model:0.5,format:0.1,length:0.1'"""
    reward_fn: Optional[list[str]] = None
    """path/to/file.py:fn replacing the data_source registry for every row; repeat for several (summed with --reward-weights)"""
    reward_weights: Optional[list[float]] = None
    """weights of the --reward-fn functions, in order (default: 1 each); each is logged as reward/<fn>"""
    reward_fallback: Optional[float] = None
    """score given when a reward function fails (default: stop with an error naming the row)"""
    reward_timeout: float = 60.0
    """seconds one reward-function call may take before it counts as failed (error naming the row, or --reward-fallback; 0: no limit)"""
    reward_workers: int = 2
    """processes that run --reward-fn functions off the training loop (a crash or hang there costs a row, not the run); 0: in this process"""
    num_eval_prompts: int = 64
    """validation prompts per evaluation (greedy)"""

    # --- generation
    max_new_tokens: Annotated[int, tyro.conf.arg(aliases=("--max-completion-length",))] = 48
    """response length limit (tokens)"""
    temperature: float = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling"""
    top_k: int = 0
    """top-k sampling (0: off)"""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """hf: our decoding loop on the policy (exactly reproducible); vllm: a vLLM engine in this process, the
    policy's weights pushed into it after each update, pi_old recomputed by the trainer (docs/rollout.md)"""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm on GPUs: the share of GPU memory the engine may take (weights + KV cache), next to training"""
    vllm_kv_cache_gb: float = 1.0
    """vllm on CPU: KV-cache space (GiB)"""
    vllm_tensor_parallel_size: int = 1
    """vllm on GPUs: devices one engine spans (tensor-parallel generation)"""
    vllm_sleep: bool = False
    """vllm on GPUs: free the engine's memory during each update (sleep after a rollout, wake before the next)"""

    # --- optimisation
    total_steps: int = 100
    """training iterations (rollout + update)"""
    num_prompts: int = 8
    """prompts per iteration, over all processes"""
    group_size: Annotated[int, tyro.conf.arg(aliases=("--num-generations",))] = 4
    """G: responses sampled per prompt"""
    mini_batch_size: int = 32
    """sequences per optimizer step, over all processes"""
    micro_batch_size: int = 8
    """sequences per forward/backward on one process"""
    micro_batch_tokens: int = -1
    """micro-batches packed by length: rows sorted longest first, packed while rows x padded length <= this many
    tokens, each run at its own longest prompt and response (less padding, same loss); -1: the budget of
    --micro-batch-size rows at the batch's full length (same memory bound); 0: --micro-batch-size rows, unpacked"""
    update_epochs: Annotated[int, tyro.conf.arg(aliases=("--num-iterations",))] = 1
    """mu: optimisation passes over each batch (1: on-policy, old log-probs = sampling log-probs); TRL's --num-iterations"""
    learning_rate: float = 5e-6
    """learning rate"""
    lr_scheduler: str = "constant_with_warmup"
    """transformers scheduler name (constant_with_warmup, linear, cosine, ...)"""
    warmup_steps: int = 0
    """optimizer steps of linear warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping"""

    # --- algorithm
    baseline: Literal["group-mean", "rloo"] = "group-mean"
    """group-mean (GRPO) or rloo (leave-one-out mean of the other G-1 rewards)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the group's std (GRPO), the batch's std, or not at all (Dr. GRPO)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """token-mean (DAPO), seq-mean-token-mean (GRPO paper), seq-mean-token-sum-norm (Dr. GRPO: / max_new_tokens)"""
    clip_eps_low: float = 0.2
    """lower ratio clip: ratio >= 1 - eps_low"""
    clip_eps_high: float = 0.2
    """upper ratio clip: ratio <= 1 + eps_high (DAPO clip-higher: 0.28)"""
    kl_coef: Annotated[float, tyro.conf.arg(aliases=("--beta",))] = 0.0
    """weight of the KL to the reference in the loss (0: no reference model is loaded)"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """per-token KL estimator in the loss"""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal, sample more prompts to refill the batch"""
    max_resample_rounds: int = 3
    """dynamic sampling: extra sampling rounds at most; a batch still short is filled with dropped groups"""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: responses longer than max_new_tokens - buffer lose up to overlong_penalty"""
    overlong_penalty: float = 1.0
    """reward subtracted at max_new_tokens (linear from 0 at max_new_tokens - buffer)"""
    mask_truncated: bool = False
    """exclude responses cut at max_new_tokens from the loss (DAPO overlong filtering)"""
    tis_cap: float = 0.0
    """truncated importance sampling: weight each token's loss by min(pi_old / pi_sampler, C) (0 = off)"""

    health: HealthConfig = field(default_factory=HealthConfig)
    """training-health warning thresholds (--health.kl-max, ...; docs/experiments.md)"""

    # --- filled at runtime
    world_size: int = field(default=1, init=False)
    local_num_prompts: int = field(default=0, init=False)
    local_mini_batch_size: int = field(default=0, init=False)
    old_logprobs_from: str = field(default="", init=False)
    """runtime: 'sampler' (pi_old = the sampler's log-probs, provably equal here), 'current' (one optimizer step
    per batch: pi_old = the update forward's own log-probs, detached) or 'trainer' (recomputed before the update)"""


# ALGO LOGIC: advantages, reward shaping and loss aggregation
def compute_advantages(scores, group_size, baseline, scale_rewards, eps=1e-6):
    """scores: (N*G,) with a prompt's G samples adjacent -> advantages (N*G,).
    group-mean: score - group mean (GRPO); rloo: score - mean of the other G-1 (Ahmadian et al. 2024).
    Then divided by the group's unbiased std + eps (group), the global batch's std over all processes
    (batch; groups never straddle ranks, so the group statistics need no communication), or nothing
    (none, Dr. GRPO). A group of equal scores gives exactly 0, never NaN. eps = 1e-6 as in the GRPO
    reference code (TRL uses 1e-4)."""
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


def take_informative_groups(parts, G, n_groups, pad_id):
    """Dynamic sampling: from sampled batches `parts` (dicts of (B, ...) tensors and lists, a prompt's
    G samples adjacent), build one batch of `n_groups` groups, those whose rewards differ first, then
    (if too few) groups with equal rewards to keep the batch size fixed. Queries are re-padded on the
    left, responses on the right. Returns (batch, number of equal-reward groups used to fill)."""
    picked = [(p, j) for p in parts for j in range(len(p["rows"]) // G) if p["scores"].view(-1, G)[j].std() > 0]
    n_informative = min(len(picked), n_groups)
    picked = (
        picked[:n_groups]
        + [(p, j) for p in parts for j in range(len(p["rows"]) // G) if not p["scores"].view(-1, G)[j].std() > 0][
            : n_groups - n_informative
        ]
    )
    P = max(p["queries"].shape[1] for p, _ in picked)
    T = max(p["responses"].shape[1] for p, _ in picked)
    out = {}
    for key, v in parts[0].items():
        items = [(p[key], list(range(j * G, (j + 1) * G))) for p, j in picked]
        if isinstance(v, list):
            out[key] = [x[i] for x, idx in items for i in idx]
        elif key in ("queries", "query_mask"):  # left padding
            fill = pad_id if key == "queries" else 0
            out[key] = torch.cat([F.pad(x[idx], (P - x.shape[1], 0), value=fill) for x, idx in items])
        elif v.dim() == 2:  # responses, masks, log-probs: right padding
            fill = pad_id if key == "responses" else 0
            out[key] = torch.cat([F.pad(x[idx], (0, T - x.shape[1]), value=fill) for x, idx in items])
        else:
            out[key] = torch.cat([x[idx] for x, idx in items])
    return out, n_groups - n_informative


def clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps_low, clip_eps_high):
    """Per-token PPO loss with asymmetric clipping. (b, T) each, advantages (b, 1) broadcast. Returns (loss, clipped)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20, 20))  # as verl: a ratio that exploded stays finite
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high)
    return torch.max(pg1, pg2), (pg2 > pg1).float()


def main(args: Args):
    # ------------------------------------------------------------------ setup  # TRY NOT TO MODIFY
    # as launched: DDP, FSDP2 or DeepSpeed; without GPU, CPU processes over gloo; --mixed-precision
    accelerator = make_accelerator(args.mixed_precision, args.model_name_or_path, args.dtype, args.tp_size)
    device = accelerator.device
    G = args.group_size
    if G < 2:
        raise UserError("--group-size must be >= 2: advantages compare the samples of a prompt")
    args.world_size = accelerator.num_processes
    args.local_num_prompts = exact_div(args.num_prompts, args.world_size, "--num-prompts over the number of processes")
    args.local_mini_batch_size = exact_div(
        args.mini_batch_size, args.world_size, "--mini-batch-size over the number of processes"
    )
    exact_div(args.num_prompts * G, args.mini_batch_size, "--num-prompts x --group-size over --mini-batch-size")
    exact_div(
        args.local_mini_batch_size, args.micro_batch_size, "--mini-batch-size per process over --micro-batch-size"
    )
    micro_batch_tokens = micro_batch_budget(accelerator, args.micro_batch_tokens)  # DeepSpeed: row micro-batches
    # DeepSpeed only: micro-batch size, micro-batches per optimizer step, clipping
    configure_deepspeed(
        accelerator, args.micro_batch_size, args.local_mini_batch_size // args.micro_batch_size, args.max_grad_norm
    )
    seed_everything(args.seed)
    log = accelerator.print
    run = Run(accelerator, args, Path(__file__).stem)  # --resume: resolved and checked before anything loads

    M.check_context(
        args.model_name_or_path,
        args.max_prompt_length + args.max_new_tokens,
        "--max-prompt-length + --max-new-tokens",
        args.trust_remote_code,
    )
    tok = M.load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    M.set_prompt_format(tok, args.apply_chat_template, args.chat_template_kwargs, args.system_prompt)
    reward = reward_from_args(args, accelerator)  # rules, a reward model (its own tokenizer), weighted mixes
    # --train-files / --val-files, else the built-in --task; every data_source checked against the rewards
    train_rows, val_rows = load_rl_prompts(args, tok, reward, log)
    sampler = Sampler(len(train_rows), args.seed)

    # ALGO LOGIC: GRPO's models and optimizer: the policy and, when --kl-coef > 0, a frozen reference;
    # no critic (the group's other samples are the baseline)
    policy = M.load_causal_lm(
        args.model_name_or_path,
        tok,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        gradient_checkpointing=args.gradient_checkpointing,
        load_in_4bit=args.load_in_4bit,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
    )
    ref_policy = None  # kl_coef 0: no reference at all; with LoRA: the adapter disabled
    if args.kl_coef > 0 and args.lora_r == 0:
        ref_policy = prepare_frozen(
            accelerator,
            M.load_causal_lm(args.model_name_or_path, tok, dtype=args.dtype, trust_remote_code=args.trust_remote_code),
            under_autocast=True,  # run inside accelerator.autocast(): bf16 matmul weights stored as bf16
        )
    n_updates = args.total_steps * args.update_epochs * (args.num_prompts * G // args.mini_batch_size)
    from transformers import get_scheduler

    # fused: one kernel per step over all parameters (5-9x faster than foreach on CPU: docs/performance.md)
    opt = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        fused=True,
    )
    sched = get_scheduler(args.lr_scheduler, opt, num_warmup_steps=args.warmup_steps, num_training_steps=n_updates)

    # ------------------------------------------------------- checkpoint state, run folder  # TRY NOT TO MODIFY
    guard = UpdateGuard(accelerator)  # non-finite gradients: step skipped, never NaN weights
    run.load_weights(policy=policy)  # resumed: the checkpoint's weights
    policy, opt, sched = accelerator.prepare(policy, opt, sched)
    engine = make_engine(args, tok, policy, accelerator)  # --rollout-engine vllm: the colocated engine; hf: None
    # pi_old may be the sampler's log-probs only where sampler and trainer compute the same numbers: one
    # pass (mu = 1), float32 weights without autocast (bf16 KV-cache decoding differs from the batched
    # forward by up to 0.24 nats on SmolLM2), our own sampler (not vLLM's kernels), and no importance
    # correction asked for. Else, with one
    # optimizer step per batch (mu = 1, one minibatch), pi_old is the policy the update's forward runs:
    # its own log-probs, detached (ratio 1, as TRL does), no extra forward. Else recompute before the update.
    same_numerics = next(policy.parameters()).dtype == torch.float32 and accelerator.mixed_precision == "no"
    one_step = args.update_epochs == 1 and args.mini_batch_size == args.num_prompts * G
    args.old_logprobs_from = (
        "trainer"
        if args.tis_cap > 0 or args.update_epochs > 1
        else "sampler"
        if same_numerics and engine is None
        else "current"
        if one_step
        else "trainer"
    )
    evaluate = lambda: evaluate_policy(
        accelerator, policy, tok, reward, val_rows, args.max_new_tokens, args.micro_batch_size, engine
    )
    # what a checkpoint holds, by name (restored here when resuming); evaluation before the first step
    run.begin(
        tok,
        models={"policy": policy},
        optimizers={"opt": ("policy", opt)},
        state=dict(sched=sched, sampler=sampler, guard=guard),
        evaluate=evaluate if val_rows else None,
    )

    def ref_logprobs_of(query_responses, attn, P):
        if ref_policy is not None:
            with accelerator.autocast():  # a frozen model is not prepared: --mixed-precision applied here
                return forward_logprobs(ref_policy, query_responses, attn, P, args.temperature)
        with accelerator.unwrap_model(policy).disable_adapter():
            return forward_logprobs(policy, query_responses, attn, P, args.temperature)

    def sample_groups(step, round_):
        """One global draw of prompts; this rank's share, each repeated G times, sampled and scored."""
        global_ids = sampler.take(args.num_prompts)
        r = accelerator.process_index
        rows = [train_rows[i] for i in global_ids[r * args.local_num_prompts : (r + 1) * args.local_num_prompts]]
        rows = [x for x in rows for _ in range(G)]  # (N*G,) a prompt's samples adjacent
        queries, query_mask = tokenize_queries(tok, [x.text for x in rows], device)  # (B, P)
        uid0 = (round_ * args.num_prompts + r * args.local_num_prompts) * G
        seeds = [mix_seed(args.seed, step, uid0 + j) for j in range(len(rows))]
        with unwrap_for_generation(accelerator, policy) as gen_model:
            rollout = generate(
                gen_model,
                tok,
                queries,
                query_mask,
                args.max_new_tokens,
                args.temperature,
                args.top_k,
                args.top_p,
                seeds,
                engine=engine,
            )
        texts = tok.batch_decode(rollout.responses, skip_special_tokens=True)
        scores, components, extras = reward(rows, texts, rollout.response_mask.sum(1), device, rollout.is_eos)  # (B,)
        return dict(
            rows=rows,
            texts=texts,
            queries=queries,
            query_mask=query_mask,
            responses=rollout.responses,
            mask=rollout.response_mask,
            logprobs=rollout.logprobs,
            truncated=rollout.truncated,
            scores=scores,
            solved=extras.get("acc", (scores >= 1).float()),
            **{f"reward/{k}": v for k, v in components.items()},
        )

    for step in run.steps():  # after each: checkpoints (periodic, final, on a signal), --max-wall-minutes
        t_step = time.time()
        # ------------------------------------------------------------------ 1. rollout (+ dynamic sampling)
        t_gen = time.time()
        batch = sample_groups(step, 0)
        rounds = n_filled = 0
        if args.dynamic_sampling:  # DAPO: keep groups whose rewards differ; all ranks run the same rounds
            parts = [batch]
            while rounds < args.max_resample_rounds:
                have = sum(int((p["scores"].view(-1, G).std(1) > 0).sum()) for p in parts)
                if accelerator.gather(torch.tensor([args.local_num_prompts - have], device=device)).max().item() <= 0:
                    break
                rounds += 1
                parts.append(sample_groups(step, rounds))
            batch, n_filled = take_informative_groups(parts, G, args.local_num_prompts, tok.pad_token_id)
        gen_s = time.time() - t_gen
        rows, texts, scores, truncated = batch["rows"], batch["texts"], batch["scores"], batch["truncated"]  # B = N*G
        mask = batch["mask"]  # (B, T)
        P, T = batch["queries"].shape[1], batch["responses"].shape[1]
        query_responses = torch.cat([batch["queries"], batch["responses"]], 1)  # (B, P+T)
        attn = sequence_attention_mask(batch["query_mask"], T)  # (B, P+T)
        lengths = mask.sum(1)  # (B,)

        # ------------------------------------------------------------------ 2. reward shaping and advantages
        scores = scores + overlong_penalty(lengths, args.max_new_tokens, args.overlong_buffer, args.overlong_penalty)
        advantages = compute_advantages(scores, G, args.baseline, args.scale_rewards)  # (B,)
        loss_mask = mask * (~truncated).float()[:, None] if args.mask_truncated else mask  # (B, T)
        # micro-batches of the no-grad forwards: --micro-batch-size rows, or by --micro-batch-tokens
        all_micros = micro_batches(
            list(range(len(rows))), batch["query_mask"], mask, args.micro_batch_size, micro_batch_tokens, accelerator
        )
        with torch.no_grad(), accelerator.autocast():  # one region: bf16 weight copies cast once, not per micro-batch
            if args.old_logprobs_from == "sampler":
                old_logprobs = batch["logprobs"]  # on-policy, same numerics: the sampler's log-probs, no extra forward
            elif args.old_logprobs_from == "current":
                old_logprobs = torch.zeros_like(mask)  # (B, T) filled by the update's forward below
            else:
                old_logprobs = (
                    forward_by_micro_batch(
                        lambda qr, am, p: forward_logprobs(policy, qr, am, p, args.temperature),
                        all_micros,
                        query_responses,
                        attn,
                        P,
                        T,
                    )
                    * mask
                )  # (B, T)
            ref_logprobs = None
            if args.kl_coef > 0:
                ref_logprobs = forward_by_micro_batch(ref_logprobs_of, all_micros, query_responses, attn, P, T) * mask

        # sampler-vs-trainer gap of pi_old (mean |delta| per token); with the sampler and current paths it
        # is measured on the first minibatch's forward below, before any optimizer step
        diff_sum, diff_n = ((old_logprobs - batch["logprobs"]).abs() * mask).sum(), mask.sum()
        if args.old_logprobs_from != "trainer":
            diff_sum, diff_n = torch.zeros_like(diff_sum), torch.zeros_like(diff_n)
        tis_weights = (
            torch.exp(old_logprobs - batch["logprobs"]).clamp(max=args.tis_cap) * mask if args.tis_cap > 0 else None
        )  # (B, T)

        # ------------------------------------------------------------------ 3. update
        t_train = time.time()
        stats = {k: [] for k in ("pg", "kl", "ent", "clip")}
        padded_tokens = real_tokens = 0.0  # of the update's forwards: perf/padding_frac
        r = accelerator.process_index
        g = torch.Generator().manual_seed(mix_seed(args.seed, step, r))
        for it in range(args.update_epochs):
            perm = torch.randperm(len(rows), generator=g).tolist()
            for mb_start in range(0, len(rows), args.local_mini_batch_size):
                mb = perm[mb_start : mb_start + args.local_mini_batch_size]
                # token totals over the global minibatch / W: DDP/FSDP average the W ranks' gradients, so
                # token-mean is over all ranks' tokens (each rank holds len(mb) sequences: n_seqs needs no reduce)
                n_tokens, n_seqs = global_mean_divisor(loss_mask[mb].sum()), len(mb)
                micros = micro_batches(
                    mb, batch["query_mask"], mask, args.micro_batch_size, micro_batch_tokens, accelerator
                )
                padded, real = padding_fraction(micros, batch["query_mask"], mask)
                padded_tokens, real_tokens = padded_tokens + padded, real_tokens + real
                for k, m in enumerate(micros):
                    # this micro-batch's rows at its own lengths: its longest prompt (p) and response (t)
                    micro, t = m.ids, m.t
                    new_logprobs, entropy = forward_logprobs(
                        policy,
                        query_responses[micro, P - m.p : P + t],
                        attn[micro, P - m.p : P + t],
                        m.p,
                        args.temperature,
                        with_entropy=True,
                    )  # (b, t) each
                    if args.old_logprobs_from == "current":  # the one optimizer step: pi_old = pi_theta now
                        old_logprobs[micro, :t] = new_logprobs.detach() * mask[micro, :t]
                    token_loss, clipped = clipped_surrogate(
                        new_logprobs,
                        old_logprobs[micro, :t],
                        advantages[micro, None],
                        args.clip_eps_low,
                        args.clip_eps_high,
                    )  # (b, t)
                    if tis_weights is not None:
                        token_loss = token_loss * tis_weights[micro, :t]
                    if args.old_logprobs_from != "trainer" and it == 0 and mb_start == 0:  # weights not yet stepped
                        diff = (new_logprobs.detach() - batch["logprobs"][micro, :t]).abs() * mask[micro, :t]
                        diff_sum, diff_n = diff_sum + diff.sum(), diff_n + mask[micro, :t].sum()
                    kl = (
                        kl_estimate(new_logprobs, ref_logprobs[micro, :t], args.kl_estimator)
                        if ref_logprobs is not None
                        else torch.zeros_like(token_loss)
                    )
                    agg = lambda x: aggregate(
                        x, loss_mask[micro, :t], args.loss_agg, n_tokens, n_seqs, args.max_new_tokens
                    )
                    pg, kl_term = agg(token_loss), agg(kl)
                    backward(accelerator, policy, pg + args.kl_coef * kl_term, last=k == len(micros) - 1)
                    for key, v in zip(stats, (pg, kl_term, agg(entropy), agg(clipped))):
                        stats[key].append(v.detach())
                guard.step(policy, opt, args.max_grad_norm, "policy", step)  # these: no-ops under DeepSpeed
                sched.step()
                opt.zero_grad()
        train_s = time.time() - t_train
        # train/kl as in the PPO scripts: per response, the token mean of KL(pi_old || pi_ref); batch mean
        mean_kl = 0.0
        if ref_logprobs is not None:
            kl = kl_estimate(old_logprobs, ref_logprobs, args.kl_estimator) * mask  # (B, T)
            mean_kl = accelerator.gather(masked_mean(kl, mask, dim=1)).mean().item()

        # ------------------------------------------------------------------ 4. log, evaluate, checkpoint
        if run.logging(step):  # --log-every, and every evaluation step and the last
            n_minibatches = args.update_epochs * len(rows) // args.local_mini_batch_size
            mean_over_minibatches = lambda xs: accelerator.reduce(torch.stack(xs).sum() / n_minibatches, "mean").item()
            all_scores = accelerator.gather(scores)
            by_group = all_scores.view(-1, G)
            step_s = time.time() - t_step
            n_fwd = 1 + (args.old_logprobs_from == "trainer") + (args.kl_coef > 0)
            metrics = {
                "train/reward": all_scores.mean().item(),
                "train/reward_std": all_scores.std().item(),
                "train/zero_std_groups": (by_group.std(1) == 0).float().mean().item(),
                "train/kl": mean_kl,
                "train/kl_coef": args.kl_coef,
                "train/sampler_logprob_diff": (all_sum(diff_sum) / all_sum(diff_n).clamp(min=1)).item(),
                "train/entropy": mean_over_minibatches(stats["ent"]),
                "train/clip_frac": mean_over_minibatches(stats["clip"]),
                "train/response_len": accelerator.gather(lengths).float().mean().item(),
                "train/truncated": accelerator.gather(truncated.float()).mean().item(),
                "train/lr": sched.get_last_lr()[0],
                "train/resample_rounds": rounds,
                "train/filled_zero_std_groups": n_filled,
                "loss/policy": mean_over_minibatches(stats["pg"]),
                "loss/kl": mean_over_minibatches(stats["kl"]),
                "loss/total": mean_over_minibatches(stats["pg"]) + args.kl_coef * mean_over_minibatches(stats["kl"]),
                "perf/step_s": step_s,
                "perf/gen_s": gen_s,
                "perf/train_s": train_s,
                "perf/tokens_per_s": accelerator.gather(lengths).sum().item() / step_s,
                "perf/peak_mem_gb": peak_mem_gb(device),
                "perf/padding_frac": 1 - real_tokens / max(padded_tokens, 1),
                # forward-only passes over the batch's real tokens: generation, pi_old (trainer), reference
                "perf/mfu": mfu(policy, n_fwd * real_tokens / args.update_epochs, real_tokens, step_s, accelerator),
                "train/episodes": step * args.num_prompts * G,
            }
            solved = accelerator.gather(batch["solved"]).view(-1, G)  # (all prompts, G) exact-match
            metrics["train/solve_all"] = (solved.min(1).values == 1).float().mean().item()
            metrics["train/solve_none"] = (solved.max(1).values == 0).float().mean().item()
            for key in [k for k in batch if k.startswith("reward/")]:
                metrics[key] = accelerator.gather(batch[key]).mean().item()
            sources = sorted({x.data_source for x in rows})
            for src in sources if len(sources) > 1 else []:  # several tasks mixed: reward per data_source
                sel = torch.tensor([x.data_source == src for x in rows], device=device)
                metrics[f"reward/{src}"] = scores[sel].mean().item()  # this rank's rows of that source
            if reward.errors:
                metrics["reward/errors"] = reward.errors
            metrics["train/skipped_steps"] = guard.skipped
            samples = [
                {"prompt": x.text, "response": t, "reward": float(s), "advantage": float(a), "split": "train"}
                for x, t, s, a in zip(rows, texts, scores, advantages)
            ]
            run.log(step, metrics, samples)  # + evaluation when due, health warnings, --save-best

    return run.end()


if __name__ == "__main__":
    cli(main, Args)  # parse flags and presets; a user error is one line and exit code 2
