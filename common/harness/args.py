"""The flags every script shares, as typed groups: each script's Args holds its algorithm's hyperparameters and
embeds these with flat flag names (`--seed`, not `--run.seed`; tyro.conf.OmitArgPrefixes):

    @dataclass
    class Args:
        clip_eps: PositiveFloat = 0.2          # the algorithm's own flags, first in --help
        ...
        run: Group[RunArgs] = group(RunArgs, exp_name=Path(__file__).stem, total_steps=100)
        model: Group[ModelArgs] = group(ModelArgs)

The script reads `args.clip_eps` (its own) and `args.run.seed`, `args.gen.temperature` (shared); common/ reads
the fields of these groups only, never a script's own flag by its spelling.

Each field carries its own rules in its type: `Check(gt=0)` (a range, checked by flags.check_args before anything
loads, with one line naming the flag), `RESUME_MAY_CHANGE` (the flag may differ on --resume; a difference in any
other flag is refused by name). Allowed values are Literal types (tyro checks them). flags.flat_args gives the flat
{flag name: value} view that args.json, trainer_state.pt, W&B config and presets use, as before the groups."""

from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional, TypeVar

import tyro

from common.core.defaults import DEFAULT_MODEL
from common.core.errors import UserError

T = TypeVar("T")
Group = Annotated[T, tyro.conf.OmitArgPrefixes]  # a group embedded with flat flag names


def group(cls, **defaults):
    """A group field with this script's defaults: `run: Group[RunArgs] = group(RunArgs, total_steps=100)`."""
    return field(default_factory=lambda: cls(**defaults))


@dataclass(frozen=True)
class Check:
    """A range rule of one flag: bounds gt / ge / lt / le (a value outside is one line: `--flag v: must be ...`),
    `note` (why, appended), or `fn(flag, value)` raising UserError for a rule that is not a range."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    note: str = ""
    fn: typing.Callable | None = None

    def __call__(self, flag: str, v) -> None:
        if self.fn is not None:
            return self.fn(flag, v)
        if isinstance(v, (list, tuple)):  # a flag of several numbers: each
            return [self(flag, x) for x in v] and None
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            return
        ok = (
            (self.gt is None or v > self.gt)
            and (self.ge is None or v >= self.ge)
            and (self.lt is None or v < self.lt)
            and (self.le is None or v <= self.le)
        )
        if ok:
            return
        lo = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else None
        hi = f"{self.lt:g})" if self.lt is not None else f"{self.le:g}]" if self.le is not None else None
        if lo and hi:
            rule = f"in {lo}, {hi}"
        elif lo:
            rule = ("> " if lo[0] == "(" else ">= ") + lo[1:]
        else:
            rule = ("< " if hi[-1] == ")" else "<= ") + hi[:-1]
        raise UserError(f"{flag} {v}: must be {rule}" + (f" ({self.note})" if self.note else ""))


RESUME_MAY_CHANGE = "resume_may_change"  # marker: how long a run goes, how it logs, saves, scores (not what it learns)

PositiveInt = Annotated[int, Check(gt=0)]
PositiveFloat = Annotated[float, Check(gt=0)]
NonNegInt = Annotated[int, Check(ge=0)]
NonNegFloat = Annotated[float, Check(ge=0)]
UnitFloat = Annotated[float, Check(ge=0, le=1)]  # [0, 1]: a discount, a GAE lambda


def _writable_dir(flag: str, out) -> None:
    p = Path(out)
    if p.is_symlink() and not p.exists():
        raise UserError(f"{flag} {out}: a symlink to nothing ({os.readlink(p)}); point it at a folder")
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {out}: a file, not a folder")
    existing = next((q for q in [p, *p.parents] if q.exists()), None)
    if existing is not None and not existing.is_dir():  # a folder would be made under a file
        raise UserError(f"{flag} {out}: {existing} is a file, not a folder")
    if existing is not None and existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {out}: {existing} cannot be written (permissions)")


def _trained_dtype(flag: str, v) -> None:
    if v == "float16":
        raise UserError(
            f"{flag} float16: training float16 weights needs a loss scaler, which is not built; use --dtype float32 "
            "(the default: with --mixed-precision bf16 on GPUs) or --dtype bfloat16"
        )


TRACKERS = ("wandb", "tensorboard", "mlflow", "trackio", "swanlab", "clearml", "comet_ml", "aim", "dvclive")


def _trackers(flag: str, v) -> None:
    unknown = [n for n in str(v).split(",") if n and n not in TRACKERS]
    if unknown:
        raise UserError(f"{flag} {v}: unknown tracker(s) {unknown}; use {', '.join(TRACKERS)}")


def _http_url(flag: str, v) -> None:
    if v is not None and not str(v).startswith(("http://", "https://")):
        raise UserError(f"{flag} {v}: not an http:// or https:// URL")


def _readable_file(flag: str, v) -> None:
    if v is not None and not Path(v).is_file():
        raise UserError(f"{flag} {v}: no such file")


# ----------------------------------------------------------------------------------------------------- the groups
@dataclass
class RunArgs:
    """experiment, run folder, checkpoints, evaluation cadence, tracking"""

    exp_name: str = "run"
    """name of this experiment (W&B group; part of the run folder name); default: the script's name"""
    seed: int = 1
    """seed of model init, data order, sampling and minibatch shuffling"""
    total_steps: Annotated[PositiveInt, RESUME_MAY_CHANGE] = 100
    """training steps (RL: one rollout + update each; otherwise one optimizer step)"""
    track: Annotated[bool, RESUME_MAY_CHANGE] = False
    """log to Weights & Biases (works with WANDB_MODE=offline); the same as --report-to wandb"""
    report_to: Annotated[str, RESUME_MAY_CHANGE, Check(fn=_trackers)] = ""
    """trackers besides metrics.jsonl, comma-separated: wandb, tensorboard, mlflow, trackio, swanlab, clearml,
    comet_ml, aim, dvclive (Accelerate's tracker classes; docs/experiments.md)"""
    wandb_project_name: Annotated[str, RESUME_MAY_CHANGE] = "cleanrlhf"
    """W&B project"""
    wandb_entity: Annotated[Optional[str], RESUME_MAY_CHANGE] = None
    """W&B entity (team or user)"""
    config: Annotated[Optional[str], RESUME_MAY_CHANGE] = None
    """YAML preset (keys = the flag names, - or _); CLI flags override it"""
    output_dir: Annotated[str, RESUME_MAY_CHANGE, Check(fn=_writable_dir)] = "runs"
    """where run folders are created"""
    resume: Annotated[Optional[str], RESUME_MAY_CHANGE] = None
    """checkpoint folder or run folder (its latest checkpoint) to continue exactly, in that run's folder; 'auto':
    the latest run of this exp_name/seed if any"""
    save_every: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 0
    """save a checkpoint every N steps (0: only at the end)"""
    save_every_minutes: Annotated[NonNegFloat, RESUME_MAY_CHANGE] = 30.0
    """also save when this many minutes have passed since the last save (0: off), so a pre-empted run loses little"""
    max_wall_minutes: Annotated[NonNegFloat, RESUME_MAY_CHANGE] = 0.0
    """stop after the step that passes this many minutes of wall time since setup ended (checkpoint and final
    evaluation as at --total-steps), so recipes compare at equal cost; 0: no limit"""
    keep_last: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 0
    """keep only the last K checkpoints (0: keep all)"""
    save_merged: Annotated[bool, RESUME_MAY_CHANGE] = False
    """LoRA: each checkpoint also holds {model}_merged/, the full merged model (loads without peft: vLLM, TGI)"""
    checkpoint_format: Annotated[Literal["full", "sharded"], RESUME_MAY_CHANGE] = "full"
    """full: each model a save_pretrained folder, gathered on one process; sharded: torch.distributed.checkpoint,
    each process writes its own shards (no gather; for FSDP2 / TP runs), resumable on any number of processes, its
    model folders converted to full ones on first load (docs/distributed.md)"""
    save_best: Annotated[Optional[str], RESUME_MAY_CHANGE] = None
    """keep checkpoints/best/, the checkpoint of the best value so far of this metric (e.g. eval/accuracy; losses:
    lowest)"""
    eval_every: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 10
    """evaluate every N steps (and before the first and after the last; 0: never)"""
    log_every: Annotated[PositiveInt, RESUME_MAY_CHANGE] = 1
    """write metrics every N steps"""
    num_samples_logged: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 4
    """rollouts (or pairs, examples) written to samples.jsonl and a W&B table per log interval"""


@dataclass
class ModelArgs:
    """the trained model: weights, precision, LoRA / QLoRA, parallelism"""

    model_name_or_path: str = DEFAULT_MODEL
    """the trained model: hub id, local folder (a checkpoint's model folder), or the offline default alias"""
    trust_remote_code: bool = False
    """allow model code from the hub"""
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Check(fn=_trained_dtype)] = "auto"
    """weights dtype of the trained models (auto: float32, with bf16 autocast on GPUs; under LoRA the frozen base
    at the device's default, bf16 on GPUs); bfloat16: bf16 weights with a Kahan-compensated AdamW
    (common/parallel/optim.py)"""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """bf16: autocast forward/backward in bfloat16 (float32 weights, optimizer, log-softmax); auto: bf16 where it
    pays (float32 weights, a CPU with native bf16 matmul, hidden size >= 256: docs/performance.md), else as
    `accelerate launch --mixed_precision` says; no: float32"""
    tp_size: Annotated[PositiveInt, RESUME_MAY_CHANGE] = (
        1  # the same models laid out otherwise: full-weight checkpoints
    )
    """tensor parallelism: each model sharded over groups of this many processes (launch tp_size x data-parallel
    processes with torchrun / accelerate launch; batch flags count data-parallel ranks): docs/distributed.md"""
    lora_r: NonNegInt = 0
    """LoRA rank of the trained models (0 = full fine-tuning); a reference is then the adapter disabled"""
    lora_alpha: PositiveInt = 32
    """LoRA alpha"""
    load_in_4bit: bool = False
    """QLoRA: 4-bit base weights (needs CUDA and --lora-r > 0)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""


@dataclass
class DataArgs:
    """training and held-out files (the script's format: docs/data.md), how prompts are rendered"""

    train_files: Optional[list[str]] = None
    """training files (parquet/jsonl/arrow or a hub id; the script's format: docs/data.md); default: the built-in
    --task"""
    val_files: Optional[list[str]] = None
    """held-out files in the same format (default: the built-in task's test split)"""
    task: str = "chain_sum_1d"
    """built-in reasoning-gym task used when no --train-files are given"""
    apply_chat_template: bool = True
    """render prompts with the tokenizer's chat template (--no-apply-chat-template: raw text, for base models)"""
    chat_template_kwargs: Optional[str] = None
    """JSON keyword arguments for apply_chat_template, e.g. '{"enable_thinking": false}'"""
    system_prompt: Optional[str] = None
    """system message put first in every prompt (default: none beyond what the chat template adds)"""


@dataclass
class PromptArgs(DataArgs):
    """prompt files (verl schema: prompt, data_source, reward_model, extra_info), how prompts are rendered"""

    prompt_key: str = "prompt"
    """column holding the prompt"""
    reward_fn_key: str = "data_source"
    """column selecting the reward function"""
    max_prompt_length: PositiveInt = 256
    """prompts longer than this (tokens) are dropped, or cut with --truncate-prompts"""
    truncate_prompts: bool = False
    """keep the last --max-prompt-length tokens of long prompts instead of dropping them"""
    num_eval_prompts: NonNegInt = 64
    """validation prompts per evaluation (greedy)"""


@dataclass
class RewardArgs:
    """rewards: rule functions by data_source, --reward-fn files, a reward model, weighted mixes"""

    reward: str = "rule:1.0"
    """weighted reward sources, e.g. 'rule:1.0,model:0.5,format:0.1,length:0.1'"""
    reward_fn: Optional[list[str]] = None
    """path/to/file.py:fn replacing the data_source registry for every row; repeat for several (summed with
    --reward-weights)"""
    reward_weights: Optional[list[float]] = None
    """weights of the --reward-fn functions, in order (default: 1 each); each is logged as reward/<fn>"""
    reward_model: Optional[str] = None
    """sequence-classification reward model (used by a 'model' term in --reward)"""
    reward_fallback: Optional[float] = None
    """score given when a reward function fails (default: stop with an error naming the row)"""
    reward_timeout: Annotated[NonNegFloat, RESUME_MAY_CHANGE] = 60.0
    """seconds one reward-function call may take before it counts as failed (error naming the row, or
    --reward-fallback; 0: no limit)"""
    reward_workers: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 2
    """processes that run --reward-fn functions off the training loop (a crash or hang there costs a row, not the
    run); 0: in this process"""
    reward_worker_max_gb: Annotated[NonNegFloat, RESUME_MAY_CHANGE] = 4.0
    """a reward worker whose resident memory passes this many GiB is replaced after the batch (a leaking
    --reward-fn function); 0: never"""
    reward_url: Annotated[Optional[str], Check(fn=_http_url)] = None
    """a reward service (the protocol: docs/data.md; `python -m tools.serve_rm RM_FOLDER` serves a reward model):
    the 'remote' term of --reward"""
    judge_url: Annotated[Optional[str], Check(fn=_http_url)] = None
    """an OpenAI-compatible endpoint (e.g. http://localhost:8000/v1 of `vllm serve`) grading each response: the
    'judge' term of --reward"""
    judge_model: Optional[str] = None
    """the model name the --judge-url endpoint serves"""
    judge_template: Annotated[Optional[str], Check(fn=_readable_file)] = None
    """a file holding the judge's prompt, with {prompt}, {response}, {ground_truth}, {data_source}; it asks for
    "Score: N", N from 0 to 10 (default: such a grading prompt, common/integrations/remote_rewards.py)"""
    service_timeout: Annotated[PositiveFloat, RESUME_MAY_CHANGE] = 30.0
    """seconds one request to --reward-url / --judge-url may take"""
    service_retries: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 3
    """retries of a failed request (backoff 0.5 s, doubled each time); then the error, or --reward-fallback"""
    service_concurrency: Annotated[PositiveInt, RESUME_MAY_CHANGE] = 4
    """requests in flight at once to a reward service"""


@dataclass
class GenerationArgs:
    """sampling and the rollout engine (hf or vllm)"""

    max_new_tokens: Annotated[PositiveInt, tyro.conf.arg(aliases=("--max-completion-length",))] = 48
    """response length limit (tokens)"""
    temperature: Annotated[float, Check(gt=0, note="sampling; evaluation is greedy already")] = 1.0
    """sampling temperature (log-probs are computed at the same temperature)"""
    top_p: Annotated[float, Check(gt=0, le=1)] = 1.0
    """nucleus sampling"""
    top_k: NonNegInt = 0
    """top-k sampling (0: off)"""
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = "hf"
    """hf: our decoding loop on the policy (exactly reproducible); vllm: a vLLM engine in this process, the
    policy's weights pushed into it after each update, pi_old recomputed by the trainer (docs/rollout.md);
    vllm-server: vLLM's own server (--vllm-server-url, or one started here), weights pushed to it by version"""
    vllm_gpu_memory_utilization: Annotated[float, Check(gt=0, le=1, note="a share of the GPU's memory")] = 0.3
    """vllm on GPUs: the share of GPU memory the engine may take (weights + KV cache), next to training"""
    vllm_kv_cache_gb: PositiveFloat = 1.0
    """vllm on CPU: KV-cache space (GiB)"""
    vllm_tensor_parallel_size: PositiveInt = 1
    """vllm on GPUs: devices one engine spans (tensor-parallel generation)"""
    vllm_sleep: bool = False
    """vllm on GPUs: free the engine's memory during each update (asleep after each rollout phase, woken once before
    the next: weights, then the push, then the KV cache; `perf/vllm_wakes` counts)"""
    vllm_enforce_eager: Annotated[Literal["auto", "on", "off"], RESUME_MAY_CHANGE] = "auto"
    """vllm engines: eager mode (no CUDA graphs, no torch.compile: start-up in seconds, decoding 1.5-3x slower for
    0.5-3B models). auto: on on CPU, off on GPUs"""
    vllm_lora_sync: Literal["adapter", "merged"] = "adapter"
    """vllm engines with --lora-r: push the adapter alone (a few MB; vLLM applies it) or the merged weights (the
    fallback: also where the adapter has modules_to_save or DoRA)"""
    vllm_server_url: Annotated[str, RESUME_MAY_CHANGE] = ""
    """vllm-server: a running `vllm serve` to attach to (its flags: docs/distributed.md); empty: start one here"""
    vllm_server_args: Annotated[str, RESUME_MAY_CHANGE] = ""
    """vllm-server started here: more `vllm serve` flags (e.g. "--tensor-parallel-size 2")"""
    vllm_server_devices: Annotated[str, RESUME_MAY_CHANGE] = ""
    """vllm-server started here: its CUDA_VISIBLE_DEVICES (GPUs the trainer does not use)"""
    vllm_server_port: Annotated[NonNegInt, RESUME_MAY_CHANGE] = 0
    """vllm-server started here: its port (0: a free one; several training processes need it given)"""
    vllm_server_weights_dir: Annotated[str, RESUME_MAY_CHANGE] = ""
    """vllm-server: the folder the weights are written to for the server to reload (storage both can read;
    empty: a temporary folder, in /dev/shm when it has room)"""
    vllm_server_transfer: Literal["folder", "nccl"] = "folder"
    """vllm-server: how weights go to the server. folder: a safetensors file the server reloads (CPU and GPU);
    nccl: vLLM's NCCL weight transfer from trainer process 0 (GPUs; docs/distributed.md)"""
    vllm_server_timeout: Annotated[PositiveFloat, RESUME_MAY_CHANGE] = 300.0
    """vllm-server: seconds each request and each weight push may take before the run ends (checkpointed); a
    batch of many rows may take longer in all, as long as each request answers within its own deadline"""
    vllm_server_concurrency: Annotated[PositiveInt, RESUME_MAY_CHANGE] = 64
    """vllm-server: requests in flight at once per training process (the rest wait their turn, their deadlines not
    started)"""
    vllm_server_host: Annotated[str, RESUME_MAY_CHANGE] = "127.0.0.1"
    """vllm-server started here: the address it binds (0.0.0.0 when trainer processes on other nodes use it; they
    then need --vllm-server-url with this node's address)"""
    vllm_server_start_timeout: Annotated[PositiveFloat, RESUME_MAY_CHANGE] = 600.0
    """vllm-server started here: seconds to wait for it to answer /health"""

    def enforce_eager(self) -> bool | None:
        """--vllm-enforce-eager as the engines take it (None: auto, on on CPU only)."""
        return {"auto": None, "on": True, "off": False}[self.vllm_enforce_eager]

    def sampling(self) -> dict:
        """The keywords of common.core.generation.generate that these flags set."""
        return dict(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )


def _tis_cap(flag: str, v) -> None:
    if v < 0:
        raise UserError(f"{flag} {v}: must be >= 0")
    if 0 < v < 1:
        raise UserError(f"{flag} {v}: must be 0 (off) or >= 1 (a threshold of the ratio pi_old / pi_sampler)")


@dataclass
class MismatchArgs:
    """the sampler-trainer mismatch: importance correction of rollouts whose sampler (engine, kernels, precision)
    is not the trainer's pi_old (docs/rollout.md)"""

    tis_cap: Annotated[float, Check(fn=_tis_cap)] = 0.0
    """threshold C of the importance ratio pi_old / pi_sampler: each token's loss weighted as --tis-mode says
    (0 = off; TRL's default 3, at sequence level)"""
    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """the ratio of a token (token), of its whole response (sequence: the product), or the response's per-token
    geometric mean (geometric)"""
    tis_mode: Literal["truncate", "mask", "reject"] = "truncate"
    """truncate: weight min(ratio, C) (TIS); mask: weight ratio, 0 above C (MIS); reject: weight 1 inside
    [1/C, C], else 0"""

    def correction(self) -> dict:
        """The keywords of common.core.ops.rollout_correction that these flags set."""
        return dict(cap=self.tis_cap, level=self.tis_level, mode=self.tis_mode)


def _env_spec(flag: str, v) -> None:
    builtin, hubs = ("tools", "feedback"), ("textarena:", "openenv:", "verifiers:")
    if v and v not in builtin and not v.startswith(hubs) and not (":" in v and Path(v.rpartition(":")[0]).is_file()):
        raise UserError(
            f"{flag} {v!r}: expected {' or '.join(builtin)}, textarena:GAME, openenv:URL (or an OpenEnv environment "
            "folder), or path/to/file.py:ClassName of a file that exists"
        )


@dataclass
class PackingArgs:
    """micro-batches packed by length: the RL scripts' forward/backward passes (common.core.forwards.micro_batches)"""

    micro_batch_tokens: int = -1
    """micro-batches packed by length: rows sorted longest first, packed while rows x padded length <= this many
    tokens, each run at its own longest prompt and response (less padding, same loss); -1: the budget of
    --micro-batch-size rows at the batch's full length (same memory bound); 0: --micro-batch-size rows, unpacked"""


@dataclass
class EnvArgs:
    """environments: multi-turn rollouts with tools or feedback (docs/agents.md)"""

    env: Annotated[str, Check(fn=_env_spec)] = ""
    """'' (one turn: prompt, response, reward), tools (calculator / Python tool calls), feedback (another try after a
    wrong answer), textarena:GAME (a TextArena game), openenv:URL (an OpenEnv server; or openenv:path/to/env, a folder
    of `openenv init`, whose server is started), or path/to/file.py:ClassName (your common.core.envs.Environment)"""
    env_system_prompt: str = ""
    """--env textarena:/openenv:: a system message before the environment's first message (e.g. how to write a move);
    a row's own system message wins"""
    env_opponent: str = ""
    """--env textarena:GAME of two players: the other player, path/to/file.py:fn (fn(observation text) -> action)"""
    max_turns: PositiveInt = 3
    """model turns per trajectory at most (each up to --max-new-tokens)"""
    max_trajectory_tokens: PositiveInt = 256
    """tokens after the prompt per trajectory at most (model turns and observations); past it: truncated"""
    tools: str = "calculator,python"
    """--env tools: the tools offered, comma-separated (calculator, python)"""
    tool_format: Literal["auto", "hermes", "llama3", "text", "code"] = "auto"
    """how tool calls are written: auto (from the chat template: hermes where it asks for <tool_call> (Qwen2.5/3),
    llama3 where it asks for bare JSON with "parameters" (Llama 3.x), text where it renders no tools=), text (the
    tools and a <tool_call> protocol in the system message, whatever the template), or code (ReTool's: a program
    between <code> and </code>, the turn stopped at </code>, its output back as <output>; the Python tool only)"""
    tool_timeout: PositiveFloat = 5.0
    """--env tools: wall-clock (and CPU) seconds of one Python tool call"""
    tool_memory_mb: PositiveInt = 512
    """--env tools: address-space limit of the Python tool's process (MiB)"""
    tool_output_chars: PositiveInt = 1000
    """--env tools: a tool's output is cut to this many characters"""
    tool_sandbox: Annotated[Literal["namespaces", "audit", "remote"], RESUME_MAY_CHANGE] = "namespaces"
    """--env tools: the Python tool's isolation: namespaces (an OS boundary: its own PID, mount, network namespaces,
    no privilege, a seccomp filter; docs/agents.md), audit (the weaker mode where the kernel refuses namespaces: an
    audit hook and the limits, as the trainer's user; not a boundary against hostile code), or remote (a SandboxFusion
    service at --tool-sandbox-url runs the code on its machines; its key from SANDBOX_FUSION_API_KEY)"""
    tool_sandbox_url: Annotated[str, RESUME_MAY_CHANGE] = ""
    """--tool-sandbox remote: the SandboxFusion server's address (http://host:8080, or its /run_code endpoint)"""
    turn_cost: NonNegFloat = 0.0
    """reward subtracted per tool call (tools) or per extra turn (feedback)"""
    env_timeout: Annotated[PositiveFloat, RESUME_MAY_CHANGE] = 60.0
    """seconds one environment call (reset, step, close) may take before its trajectory ends, counted in env/errors"""
    env_workers: Annotated[bool, RESUME_MAY_CHANGE] = True
    """each trajectory's environment in a worker process, killed and replaced past --env-timeout: bounded whatever
    the environment does (ignores signals, os._exit, forks). --no-env-workers: in the trainer's process, where only
    Python code that lets SIGALRM through is bounded (docs/agents.md)"""

    def budget(self, max_new_tokens: int) -> int:
        """The response positions a rollout may take: the trajectory budget with --env, else --max-new-tokens."""
        return self.max_trajectory_tokens if self.env else max_new_tokens


@dataclass
class OnlineGenerationArgs(GenerationArgs):
    """sampling and greedy evaluation, the rollout engine (hf or vllm); --max-completion-length is the script's own"""

    max_new_tokens: PositiveInt = 64
    """response length limit (tokens) of sampling and evaluation"""


@dataclass
class OptimArgs:
    """AdamW and its learning-rate schedule"""

    learning_rate: PositiveFloat = 5e-6
    """learning rate (AdamW)"""
    lr_scheduler: str = "constant_with_warmup"
    """transformers scheduler name (constant_with_warmup, linear, cosine, ...)"""
    warmup_steps: NonNegInt = 0
    """optimizer steps of linear warm-up"""
    weight_decay: NonNegFloat = 0.0
    """AdamW weight decay"""
    max_grad_norm: NonNegFloat = 1.0
    """gradient clipping (per model)"""
    optim: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = "adamw"
    """adamw: torch's (fused; KahanAdamW for bf16 weights); adamw_8bit: bitsandbytes' blockwise 8-bit moments
    (1/4 of AdamW's state; CPU and GPU); paged_adamw_8bit: the same, paged to CPU memory under GPU pressure (CUDA)"""
