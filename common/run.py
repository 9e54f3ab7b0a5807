"""Run plumbing shared by every script: config presets, seeding, the run folder, metrics and
W&B tracking, checkpoints and exact resume.

Run folder: runs/{algo}__{exp_name}__{seed}__{unix_time}/
    args.json        every Args field, world_size, distributed_type, git commit/dirty, library versions
    metrics.jsonl    one JSON object per logged step
    samples.jsonl    a few (prompt, response, reward) rows per log interval
    checkpoints/step_{N}/   save_pretrained folders + trainer_state.pt
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Args: --config presets, then CLI flags
# ---------------------------------------------------------------------------------------------
def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), where `--config PATH` (YAML, keys = field names with - or _) sets values that
    the other CLI flags then override. The preset's values are turned into CLI flags and parsed by
    tyro with the fields' types, exactly as if typed: `learning_rate: 1e-5` is a float (YAML 1.1 alone
    reads it as a string), a Literal's choices are checked, nested groups (`health: {kl_max: 1}`) work.
    An unknown key is an error naming the file, the key and the valid names."""
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    for a in argv:
        for theirs, ours in FOREIGN_FLAGS.items():
            if a == theirs or a.startswith(theirs + "="):
                user_error(f"{theirs}: not a cleanrlhf flag; {ours}")
    doc = (
        (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    )  # --help starts with the script's summary
    preset = []
    for i, a in enumerate(argv):
        path = (
            argv[i + 1]
            if a == "--config" and i + 1 < len(argv)
            else a.split("=", 1)[1]
            if a.startswith("--config=")
            else None
        )
        if path:
            if not Path(path).is_file():
                user_error(f"--config {path}: file not found")
            try:
                cfg = yaml.safe_load(open(path)) or {}
            except yaml.YAMLError as e:
                user_error(f"--config {path}: not valid YAML ({' '.join(str(e).split())})")
            if not isinstance(cfg, dict):
                user_error(f"--config {path}: expected a mapping of field names to values")
            preset = _preset_flags(cls, cfg, path)
            _tyro_cli(
                cls, preset, blame=f"--config {path}: "
            )  # the preset alone first, so a bad value is blamed on the file
            break
    argv = _merge_repeated_list_flags(cls, argv)
    return _tyro_cli(cls, preset + argv, description=doc)  # later flags win: the CLI overrides the preset


def _tyro_cli(cls, args: list[str], description: str | None = None, blame: str = ""):
    """tyro.cli, with its parse errors as one line: tyro draws a box (message, suggestions, help
    pointer); we keep the message and the first suggestion. --help is untouched (stdout, exit 0)."""
    import io

    import tyro

    buf = io.StringIO()
    try:
        with _redirect_stderr(buf):
            return tyro.cli(cls, args=args, description=description)
    except SystemExit as e:
        text = buf.getvalue()
        if e.code in (0, None) or not text.strip():
            sys.stderr.write(text)
            raise
        # the box: unicode (╭─ title ─╮, │ lines │) or plain (title, a line of dashes, lines)
        lines = [line for line in text.splitlines() if line.strip()]
        inner = lambda line: line.strip().strip("│|").strip()
        is_rule = lambda line: line.strip()[:1] in "╭╰" or set(inner(line)) <= set("─-━=+ ")
        if len(lines) > 1 and not is_rule(lines[0]) and is_rule(lines[1]):
            lines = lines[1:]  # a plain box's title line
        sections, current = [], []
        for line in lines + ["-"]:
            if is_rule(line):
                if current:
                    sections.append(current)
                current = []
            else:
                current.append(inner(line))
        message = " ".join(sections[0]) if sections else text.strip()
        hint = next(
            (s[1].split()[0] for s in sections[1:] if s[0].startswith("Perhaps you meant") and len(s) > 1), None
        )
        user_error(f"error: {blame}{message}" + (f"; perhaps you meant {hint}" if hint else "") + " (see --help)")


def _merge_repeated_list_flags(cls, argv: list[str]) -> list[str]:
    """`--reward-fn a.py:f --reward-fn b.py:g` -> `--reward-fn a.py:f b.py:g` for list-typed fields (tyro
    alone would keep only the last). Other flags are left as they are."""
    import typing

    def is_list(t):
        return t is list or typing.get_origin(t) is list or any(is_list(a) for a in typing.get_args(t))

    list_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.init and is_list(f.type)}
    out, first_end = [], {}
    i = 0
    while i < len(argv):
        a = argv[i]
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        if a in list_flags and a in first_end:  # a repeat: its values go after the first occurrence's
            pos = first_end[a]
            out[pos:pos] = argv[i + 1 : j]
            for k in first_end:
                first_end[k] += (j - i - 1) if first_end[k] >= pos and k != a else 0
            first_end[a] = pos + (j - i - 1)
        else:
            if a in list_flags:
                first_end[a] = len(out) + (j - i)
            out += argv[i:j]
        i = j
    return out


# Flags users bring from TRL / verl that have no exact equivalent here: one line saying which of ours to use.
# (Exact equivalents are aliases on the fields themselves: --num-generations, --beta, --max-completion-length.)
FOREIGN_FLAGS = {
    "--per-device-train-batch-size": "batch flags here are global over processes: --micro-batch-size is the per-process "
    "forward/backward size, --batch-size (PPO, DPO, SFT, RM) or --num-prompts (GRPO) the "
    "samples per step over all processes",
    "--gradient-accumulation-steps": "accumulation follows from the sizes: --mini-batch-size (or --batch-size) over "
    "--micro-batch-size x processes",
}


def user_error(message: str) -> None:
    """A user error: one line on stderr, exit code 2 (no traceback)."""
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(2)


class UserError(ValueError):
    """Bad input from the user (a flag, a path, a data row, a reward function): `cli` prints its message
    as one line and exits 2. Tracebacks are for bugs (set CLEANRLHF_DEBUG=1 to see one anyway)."""


# Range checks of the flags every script shares by name, made before anything loads.
POSITIVE = (
    "batch_size",
    "mini_batch_size",
    "micro_batch_size",
    "total_steps",
    "max_new_tokens",
    "group_size",
    "num_prompts",
    "update_epochs",
    "log_every",
    "num_samples",
    "max_length",
    "max_prompt_length",
    "max_completion_length",
    "learning_rate",
    "critic_learning_rate",
    "clip_eps",
    "clip_eps_low",
    "clip_eps_high",
    "clip_eps_value",
    "beta_max",
    "policy_kl_target",
    "lora_alpha",
    "samples",
    "train_size",
    "test_size",
)
NON_NEGATIVE = (
    "save_every",
    "eval_every",
    "keep_last",
    "warmup_steps",
    "lora_r",
    "top_k",
    "num_eval_prompts",
    "num_eval_pairs",
    "num_eval_examples",
    "num_samples_logged",
    "kl_coef",
    "ent_coef",
    "vf_coef",
    "weight_decay",
    "critic_warmup_steps",
    "overlong_buffer",
    "max_resample_rounds",
    "missing_eos_penalty",
    "tis_cap",
    "sft_coef",
    "label_smoothing",
    "save_every_minutes",
    "max_wall_minutes",
    "max_grad_norm",
    "beta_min",
    "reward_timeout",
    "reward_workers",
    "n",
)


def check_args(args) -> None:
    """One line naming the flag and the valid range for a value no run could use."""

    def flag(name):
        return "--" + name.replace("_", "-")

    for name in POSITIVE:
        v = getattr(args, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 0:
            raise UserError(f"{flag(name)} {v}: must be > 0")
    for name in NON_NEGATIVE:
        v = getattr(args, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= 0:
            raise UserError(f"{flag(name)} {v}: must be >= 0")
    greedy_at_zero = any(
        f.name == "temperature" and f.default == 0 for f in dataclasses.fields(args)
    )  # evaluate: 0 = greedy
    if getattr(args, "temperature", 1.0) < 0 or (not greedy_at_zero and getattr(args, "temperature", 1.0) == 0):
        raise UserError(f"--temperature {args.temperature}: must be > 0 (sampling; evaluation is greedy already)")
    if getattr(args, "sample_temperature", 1.0) <= 0:
        raise UserError(
            f"--sample-temperature {args.sample_temperature}: must be > 0 (greedy accuracy is always reported)"
        )
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name, 1.0) <= 1:
            raise UserError(f"{flag(name)} {getattr(args, name)}: must be in [0, 1]")
    fallback = getattr(args, "reward_fallback", None)
    if fallback is not None and not math.isfinite(fallback):
        raise UserError(f"--reward-fallback {fallback}: must be a finite number (it replaces a failed reward)")
    if getattr(args, "label_smoothing", 0.0) >= 0.5:
        raise UserError(f"--label-smoothing {args.label_smoothing}: must be < 0.5")


def cli(main, cls):
    """The scripts' entry point: parse the flags (presets included), check their ranges, run `main`, and
    turn a UserError (and our data/reward errors, which are UserErrors) into one line on stderr with
    exit code 2."""
    args = parse_args(cls)
    try:
        check_args(args)
        return main(args)
    except UserError as e:
        if os.environ.get("CLEANRLHF_DEBUG"):
            raise
        user_error(f"error: {e}")


class StopSignal:
    """SIGINT / SIGTERM (Ctrl-C, SLURM or Kubernetes pre-emption) end the run cleanly: the current step
    finishes, a checkpoint is written, the resume command is printed and the process exits 130 / 143.
    A second signal exits at once. `requested()` is collective (any rank's signal stops every rank at
    the same step), so call it on every rank once per step."""

    def __init__(self, accelerator):
        import signal

        self.accelerator, self.signum, self._started = accelerator, None, time.time()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.signum is not None:  # the second signal: stop now
            os._exit(128 + signum)
        self.signum = signum
        print(
            f"\n[cleanrlhf] signal {signum}: finishing this step, then a checkpoint (send it again to stop now)",
            file=sys.stderr,
            flush=True,
        )

    def requested(self) -> bool:
        flag = torch.tensor([float(self.signum or 0)], device=self.accelerator.device)
        if self.accelerator.state.num_processes > 1:
            flag = self.accelerator.reduce(flag, "max")
        self.signum = int(flag.item()) or None
        return self.signum is not None

    def save_due(self, minutes: float) -> bool:
        """True (on every rank alike) when `minutes` have passed since the last call that returned True
        (or since the start): --save-every-minutes, so a pre-empted job loses at most that much."""
        now = time.time()
        last = getattr(self, "_last_save", None)
        if last is None:
            last = self._last_save = now
        flag = torch.tensor([float(minutes > 0 and now - last >= 60 * minutes)], device=self.accelerator.device)
        if self.accelerator.state.num_processes > 1:
            flag = self.accelerator.reduce(flag, "max")
        if flag.item():
            self._last_save = now
        return bool(flag.item())

    def out_of_time(self, minutes: float) -> bool:
        """True (on every rank alike) once `minutes` of wall time have passed since this object was made
        (the end of setup): --max-wall-minutes, so recipes are compared at equal cost. 0: never."""
        spent = time.time() - self._started
        flag = torch.tensor([float(minutes > 0 and spent >= 60 * minutes)], device=self.accelerator.device)
        if self.accelerator.state.num_processes > 1:
            flag = self.accelerator.reduce(flag, "max")
        if flag.item():
            self.accelerator.print(
                f"[cleanrlhf] --max-wall-minutes {minutes:g}: {spent / 60:.1f} min spent, this step is the last"
            )
        return bool(flag.item())

    def exit(self, run_dir: Path, step: int) -> None:
        """After the checkpoint: say how to resume, exit non-zero."""
        self.accelerator.print(
            f"[cleanrlhf] stopped at step {step}; checkpoint written. Resume with:\n"
            f"    {' '.join([sys.executable, *sys.argv])} --resume {run_dir}"
        )
        self.accelerator.wait_for_everyone()
        raise SystemExit(128 + self.signum)


class _redirect_stderr:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        self.old, sys.stderr = sys.stderr, self.f

    def __exit__(self, *exc):
        sys.stderr = self.old


def _preset_flags(cls, cfg: dict, path: str, prefix: str = "") -> list[str]:
    """A preset mapping -> the CLI flags that say the same (`learning_rate: 1e-5` -> `--learning-rate 1e-5`)."""
    import typing

    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # flag aliases (tyro.conf.arg(aliases=...): --ppo-epochs, --num-samples, ...) work as keys too
    hints = typing.get_type_hints(cls, include_extras=True)
    aliases = {
        alias.lstrip("-").replace("-", "_"): name
        for name in fields
        for meta in getattr(hints.get(name), "__metadata__", ())
        for alias in getattr(meta, "aliases", None) or ()
    }
    flags = []
    for key, value in cfg.items():
        name = str(key).replace("-", "_")
        name = aliases.get(name, name)
        if name not in fields:
            valid = ", ".join(sorted(fields))
            user_error(f"--config {path}: unknown key {prefix + str(key)!r}; valid keys: {valid}")
        flag = "--" + (prefix + name).replace("_", "-")
        f = fields[name]
        if isinstance(value, dict) and dataclasses.is_dataclass(
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        ):
            flags += _preset_flags(type(f.default_factory()), value, path, prefix=f"{prefix}{name}.")
        elif isinstance(value, bool) and f.type in (bool, "bool"):
            flags.append(flag if value else f"--{prefix}no-{name}".replace("_", "-"))  # tyro: --x / --no-x
        elif value is None:
            flags += [flag, "None"]
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def mix_seed(*parts: int) -> int:
    """One seed from several integers, the one formula of the codebase: (run seed, step, sample id)
    seeds a sample, so a response does not depend on its batch, the rank or a resume; (run seed,
    step, rank) a minibatch shuffle; (run seed, epoch) the data order. Python's hash() would be
    salted per process. s <- (s * 1_000_003 + part) mod (2^63 - 1), from s = 0."""
    s = 0
    for part in parts:
        s = (s * 1_000_003 + part) % (2**63 - 1)
    return s


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models initialise identically; per-sample randomness is derived
    from (seed, step, sample id) explicitly (common.rollout.sample_seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy's state holds an ndarray; a tensor keeps torch.load(weights_only=True) possible
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(s: dict) -> None:
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


# ---------------------------------------------------------------------------------------------
# Run folder and tracking
# ---------------------------------------------------------------------------------------------
def _git(*cmd) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "peft", "datasets", "tyro", "wandb"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# Flags a resumed run may change: how long it runs and how it logs, evaluates and saves. Any other
# difference (learning rate, batch sizes, model, data, ...) would change the optimizer or the stream
# of samples under the restored state, so resuming with it is refused by name.
RESUME_MAY_CHANGE = {
    "total_steps",
    "save_every",
    "save_every_minutes",
    "keep_last",
    "eval_every",
    "log_every",
    "num_samples_logged",
    "track",
    "wandb_project_name",
    "wandb_entity",
    "resume",
    "output_dir",
    "config",
    "save_merged",
    "save_best",
    "max_wall_minutes",
    "reward_timeout",
    "reward_workers",
    "tp_size",  # how the same models are laid out over processes (checkpoints hold full weights)
}


def _json_args(args) -> dict:
    """The user-set fields of an Args (runtime fields left out), as plain JSON values."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
    return json.loads(
        json.dumps(
            {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()}, default=str
        )
    )


def resolve_resume(args, algo: str) -> Path | None:
    """The checkpoint `--resume` names, checked before anything loads; None for a fresh run.

    `--resume PATH`: a checkpoint folder, or a run folder (its latest complete checkpoint).
    `--resume auto`: the latest checkpoint of the newest run `{algo}__{exp_name}__{seed}__*` under
    --output-dir, or a fresh start when there is none (what cluster job scripts want).
    Refused, with the reason: another algorithm's checkpoint, --total-steps not past the checkpoint's
    step, and flags that differ from the run's args.json other than RESUME_MAY_CHANGE."""
    if not args.resume:
        return None
    if args.resume == "auto":
        runs = sorted(
            Path(args.output_dir).glob(f"{algo}__{args.exp_name}__{args.seed}__*"), key=lambda p: p.stat().st_mtime
        )
        runs = [r for r in runs if list_checkpoints(r)]
        if not runs:
            return None
        ckpt = resolve_checkpoint(str(runs[-1]))
    else:
        try:
            ckpt = resolve_checkpoint(args.resume)
        except FileNotFoundError as e:
            user_error(str(e))
    run_dir = ckpt.parent.parent
    theirs = run_dir.name.split("__")[0]
    if theirs != algo:
        user_error(f"--resume {args.resume}: that is a {theirs} checkpoint; {algo} cannot continue it")
    step = _step_of(ckpt)
    if args.total_steps <= step:
        user_error(
            f"--resume {args.resume}: the checkpoint is at step {step}; --total-steps {args.total_steps} "
            f"must be larger to continue"
        )
    recorded = run_dir / "args.json"
    if recorded.exists():
        before = json.loads(recorded.read_text())
        now = _json_args(args)
        changed = {
            k: (before[k], v) for k, v in now.items() if k in before and before[k] != v and k not in RESUME_MAY_CHANGE
        }
        if changed:
            lines = "; ".join(f"--{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
            user_error(
                f"--resume {args.resume}: these flags differ from the run being resumed ({lines}). "
                f"Pass the run's own values (see {recorded}), or start a new run from "
                f"{ckpt}/<model> with --model-name-or-path"
            )
    return ckpt


def make_run_dir(accelerator, algo: str, args, resume_from: Path | None = None) -> Path:
    """The run folder: a new one, named once on the main process (its clock) and shared with every
    rank; or, when resuming, the checkpoint's own run folder, continued in place: its metrics and
    samples after the checkpoint's step are dropped (a crash between checkpoints left rows that will
    be recomputed) and args.json records the resume (time, step, flags changed)."""
    from accelerate.utils import broadcast_object_list

    if resume_from is not None:
        run_dir = Path(resume_from).parent.parent
        if accelerator.is_main_process:
            step = _step_of(Path(resume_from))
            stale = remove_stale_temp_checkpoints(run_dir)
            if stale:
                accelerator.print(f"[cleanrlhf] removed half-written checkpoint folders from a crash: {stale}")
            for name in ("metrics.jsonl", "samples.jsonl"):
                _drop_rows_after(run_dir / name, step)
            record = json.loads((run_dir / "args.json").read_text()) if (run_dir / "args.json").exists() else {}
            now = _json_args(args)
            changed = {k: [record.get(k), v] for k, v in now.items() if record.get(k) != v and k != "resume"}
            resumes = record.get("resumes", []) + [
                {
                    "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "from_step": step,
                    "world_size": accelerator.state.num_processes,
                    "tp_size": getattr(accelerator, "tp_size", 1),
                    "changed": changed,
                    "git_commit": _git("rev-parse", "HEAD"),
                    "argv": sys.argv,
                }
            ]
            record.update(now)
            record["resumes"] = resumes
            _write_atomic(run_dir / "args.json", json.dumps(record, indent=2, default=str))
        accelerator.wait_for_everyone()
        return run_dir
    name = [None]
    if accelerator.is_main_process:  # two runs started in the same second get different folders
        base = f"{algo}__{args.exp_name}__{args.seed}__{int(time.time())}"
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        for k in range(1000):
            candidate = Path(args.output_dir) / (base if k == 0 else f"{base}-{k}")
            try:
                candidate.mkdir()
                name = [candidate.name]
                break
            except FileExistsError:
                continue
    if accelerator.state.num_processes > 1:  # every process (under --tp-size, more than num_processes)
        broadcast_object_list(name, from_process=0)
    run_dir = Path(args.output_dir) / name[0]
    if accelerator.is_main_process:
        record = {
            **dataclasses.asdict(args),
            "algo": algo,
            "world_size": accelerator.state.num_processes,
            "tp_size": getattr(accelerator, "tp_size", 1),
            "distributed_type": str(accelerator.distributed_type).split(".")[-1],  # NO, MULTI_GPU, FSDP, DEEPSPEED...
            "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", None),
            "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain")),
            "versions": library_versions(),
            "argv": sys.argv,
        }
        _write_atomic(run_dir / "args.json", json.dumps(record, indent=2, default=str))
    accelerator.wait_for_everyone()
    return run_dir


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _drop_rows_after(path: Path, step: int) -> None:
    """Keep the JSON-lines rows of `path` whose step is <= `step` (in place, atomically)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    _write_atomic(path, "".join(line + "\n" for line in keep))


class Tracker:
    """metrics.jsonl (always), samples.jsonl, W&B (--track), and a rich progress line. Main process only."""

    SHOW = (
        "train/reward",
        "train/kl",
        "train/kl_coef",
        "eval/accuracy",
        "loss/policy",
        "loss/sft",
        "loss/rm",
        "rm/accuracy",
        "rewards/accuracy",
        "eval/loss",
        "perf/step_s",
    )

    def __init__(self, accelerator, args, run_dir: Path, total_steps: int, start_step: int = 0):
        self.main = accelerator.is_main_process
        self.run_dir = run_dir
        self.wandb = None
        self.progress = None
        if not self.main:
            return
        if args.track:
            import wandb

            tags = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
            commit = _git("rev-parse", "--short", "HEAD")
            # id from the folder: a resumed run continues the same W&B run
            self.wandb = wandb.init(
                project=args.wandb_project_name,
                entity=args.wandb_entity,
                name=run_dir.name,
                id="".join(c if c.isalnum() or c in "_-" else "-" for c in run_dir.name)[:128],
                resume="allow",
                group=args.exp_name,
                config=dataclasses.asdict(args),
                dir=str(run_dir),
                tags=tags + ([f"commit-{commit}"] if commit else []),
                save_code=True,
            )
            self.wandb.define_metric("train/step")
            self.wandb.define_metric("*", step_metric="train/step")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            disable=not sys.stdout.isatty(),
        )
        self.task = self.progress.add_task(
            run_dir.name.split("__")[0], total=total_steps, completed=start_step, metrics=""
        )
        self.progress.start()

    def log(self, step: int, metrics: dict) -> None:
        if not self.main:
            return
        row = {"step": step, **{k: (float(v) if not isinstance(v, str) else v) for k, v in metrics.items()}}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({**row, "train/step": step})
        shown = "  ".join(f"{k}={row[k]:.4g}" for k in self.SHOW if k in row)
        self.progress.update(self.task, completed=step, metrics=shown)
        if not sys.stdout.isatty():
            print(f"step {step}: {shown}", flush=True)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.main or not rows:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        if self.wandb is not None:
            import wandb

            cols = list(rows[0])
            self.wandb.log(
                {"samples": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows]), "train/step": step}
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def save_checkpoint(
    accelerator,
    run_dir: Path,
    step: int,
    models: dict,
    state: dict,
    keep_last: int = 0,
    tokenizer=None,
    args=None,
    save_merged: bool = False,
    label: str | None = None,
    optimizers: dict | None = None,
) -> Path:
    """checkpoints/step_{step}/{name}/ (save_pretrained) for each model + trainer_state.pt.

    trainer_state.pt holds `state` (an object's `state_dict()`, or a plain value) and each optimizer
    of `optimizers` = {key: (model name, optimizer)} under its key; `restore_checkpoint` is the mirror
    and takes the same three dicts, so a script writes its state keys once.

    Each model folder is a model: weights, config, generation config and `tokenizer`'s files (chat
    template included), so `AutoModel*.from_pretrained`, `AutoTokenizer.from_pretrained` and our own
    `--model-name-or-path` load it as it is. A LoRA model saves its adapter (plus the tokenizer; our
    loaders merge it onto its base), and with `save_merged` also `{name}_merged/`, the full merged
    model, for tools without peft (vLLM, TGI). trainer_state.pt records the algorithm and the args.
    `label` names the folder instead of `step_{step}` (e.g. "best": --save-best).

    Written into a temp folder and renamed at the end, so a crash mid-save leaves the previous
    checkpoints untouched and no half checkpoint under a step_ name. `keep_last` > 0 deletes older ones."""
    from accelerate.utils import broadcast_object_list

    from common.distributed import full_tensors, optimizer_state, reshard, save_engine_states, saved_by_one_process

    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
    for key, (name, opt) in (optimizers or {}).items():
        state[key] = optimizer_state(accelerator, models[name], opt)  # collective under FSDP2

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / (label or f"step_{step}")
    for m in models.values():
        reshard(m)  # FSDP2: units left unsharded by a no_grad forward back to DTensor shards
    state_dicts = {
        name: _drop_tied_copies(
            accelerator.unwrap_model(m), full_tensors(accelerator.get_state_dict(m))
        )  # collective under FSDP/ZeRO-3 and --tp-size
        for name, m in models.items()
    }
    tmp = [None]
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = [tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=ckpt_root)]
    if accelerator.state.num_processes > 1:
        broadcast_object_list(tmp, from_process=0)  # DeepSpeed: every rank writes its shards there
    tmp = Path(tmp[0])
    save_engine_states(accelerator, tmp, models)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            for name, m in models.items():
                unwrapped = accelerator.unwrap_model(m)
                with saved_by_one_process(unwrapped):
                    unwrapped.save_pretrained(tmp / name, state_dict=state_dicts[name], safe_serialization=True)
                folders = [tmp / name]
                if save_merged and hasattr(unwrapped, "peft_config"):
                    from common.models import merge_lora_state_dict

                    cfg = unwrapped.peft_config["default"]
                    merged = merge_lora_state_dict(state_dicts[name], cfg.lora_alpha / cfg.r)
                    unwrapped.get_base_model().save_pretrained(
                        tmp / f"{name}_merged", state_dict=merged, safe_serialization=True
                    )
                    folders.append(tmp / f"{name}_merged")
                for folder in folders if tokenizer is not None else []:
                    tokenizer.save_pretrained(folder)
            meta = {"algo": run_dir.name.split("__")[0], "args": _json_args(args) if args is not None else {}}
            torch.save({**state, **meta, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
            _fsync_tree(tmp)  # on disk before the rename makes it the checkpoint
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno == errno.ENOSPC:
                intact = max(list_checkpoints(run_dir), key=_step_of, default=None)
                raise UserError(
                    f"no space left on {ckpt_root} while writing checkpoint {final.name}; "
                    f"{intact.name + ' is intact' if intact else 'no earlier checkpoint exists'}"
                ) from e
            raise
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the folder gets the user's usual permissions
        old = None
        if final.exists():  # re-saving the same name (a resume, checkpoints/best): swap, then delete the old one
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep_last > 0:
            for old in sorted(list_checkpoints(run_dir), key=_step_of)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class BestKeeper:
    """--save-best METRIC: is this evaluation the best so far? Higher is better, except for losses
    (`loss/...`, `eval/loss`). Its state goes into checkpoints so a resumed run compares alike."""

    def __init__(self, metric: str | None):
        self.metric, self.best = metric, None

    def improved(self, metrics: dict) -> bool:
        if not self.metric or self.metric not in metrics:
            return False
        value, lower = metrics[self.metric], "loss" in self.metric
        if self.best is None or (value < self.best if lower else value > self.best):
            self.best = value
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, s: dict) -> None:
        self.best = s["best"]


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temp_checkpoints(run_dir: Path) -> list[str]:
    """`.step_N.tmp-*` / `.best.tmp-*` folders left by a crash mid-save (never a checkpoint): removed."""
    root = Path(run_dir) / "checkpoints"
    stale = [p for p in root.glob(".*.tmp-*")] + [p for p in root.glob(".*.old-*")] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def _drop_tied_copies(model, state_dict: dict) -> dict:
    """Keep one name per tied parameter (e.g. lm_head.weight = embed_tokens.weight). save_pretrained
    spots ties by shared storage, but under FSDP2 / ZeRO-3 the gathered state dict holds separate
    copies, so the folder would carry the tensor twice."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    aliases = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {k: v for k, v in state_dict.items() if k not in aliases} if state_dict is not None else state_dict


def _step_of(p: Path) -> int:
    """The step of a checkpoint folder: from its name (step_N), else (checkpoints/best) from its trainer state."""
    if p.name.startswith("step_") and p.name[5:].isdigit():
        return int(p.name[5:])
    return int(torch.load(p / "trainer_state.pt", weights_only=True)["step"])


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [
        p
        for p in root.iterdir()
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / "trainer_state.pt").exists()
    ]


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder, or a run folder (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "trainer_state.pt").exists():
        return p
    ckpts = list_checkpoints(p)
    if not ckpts:
        raise FileNotFoundError(f"--resume {path}: no complete checkpoint (checkpoints/step_N/trainer_state.pt) found")
    return max(ckpts, key=_step_of)


def load_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt, unpickled with weights_only=True: tensors and plain containers only, so a
    planted payload is refused instead of run."""
    import pickle

    try:
        return torch.load(ckpt / "trainer_state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{ckpt / 'trainer_state.pt'}: holds objects other than tensors and plain values "
            f"({str(e).splitlines()[0][:160]}); refusing to load it"
        ) from None


# Keys added to trainer_state.pt after the first checkpoints were written: an older checkpoint
# without them resumes with the object's fresh state (which is what it had then).
STATE_ADDED_LATER = {"best", "guard"}


def restore_checkpoint(accelerator, ckpt: Path, models: dict, state: dict, optimizers: dict) -> int:
    """The mirror of save_checkpoint, called after accelerator.prepare with the same dicts: each
    optimizer's state, each object's load_state_dict under its key, the RNG streams. Returns the
    step to continue after. (The weights are loaded before prepare, with load_weights.)"""
    from common.distributed import load_optimizer_state

    saved = load_trainer_state(ckpt)
    for key, (name, opt) in optimizers.items():
        load_optimizer_state(accelerator, models[name], opt, saved[key], ckpt / name)
    for key, obj in state.items():
        if key not in saved and key in STATE_ADDED_LATER:
            continue
        if key not in saved:
            raise UserError(
                f"{ckpt / 'trainer_state.pt'}: no {key!r} state (written by another version of this script?)"
            )
        obj.load_state_dict(saved[key])
    set_rng_state(saved["rng"])
    return saved["step"]


def load_weights(model, folder: Path) -> None:
    """Load a save_pretrained folder's weights into an already-built (possibly peft) model in place."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(model, sd)
        unexpected = getattr(res, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{folder}: unexpected adapter keys {unexpected[:5]}")
        return
    from torch.distributed.tensor.experimental import implicit_replication

    from common.models import full_parameters

    # ZeRO-3: parameters are partitioned from loading on; --tp-size: each DTensor keeps its shard of the full tensor
    with full_parameters(model, modify=True), implicit_replication():
        missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(
            f"{folder}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


_PEAK: dict = {}


def matmul_peak_flops(device, dtype: torch.dtype = torch.float32) -> float:
    """This machine's measured matmul rate (FLOP/s) at transformer-layer shapes, the denominator of
    perf/mfu: a datasheet peak means little on a shared CPU. Measured once (~0.5 s) and kept in
    $CLEANRLHF_CACHE/matmul_peak.json by CPU model, threads, device and dtype."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    try:
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), name)
    except OSError:
        cpu = name
    key = f"{dev.type}|{name if dev.type == 'cuda' else cpu}|{torch.get_num_threads()}|{dtype}"
    if key in _PEAK:
        return _PEAK[key]
    from common.models import cache_dir

    path = cache_dir() / "matmul_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        n = 4096 if dev.type == "cuda" else 1024
        a, b = torch.randn(n, 576, device=dev, dtype=dtype), torch.randn(576, 1536, device=dev, dtype=dtype)
        best = math.inf
        for _ in range(5):
            a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, (time.perf_counter() - t0) / 4)
        table[key] = 2 * n * 576 * 1536 / best
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
    _PEAK[key] = table[key]
    return _PEAK[key]


def mfu(model, forward_tokens: float, train_tokens: float, seconds: float, accelerator) -> float:
    """Model FLOPs utilisation of a step: (2 N per token run forward only, generation included, + 6 N
    per token trained) / seconds / the measured matmul peak of the compute dtype. N = the model's
    parameters but an untied input embedding; tokens are real tokens, so padding and recomputation show up as lost utilisation."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: the full size
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and emb.weight is not head.weight:  # an untied input embedding is a lookup, not FLOPs
        n -= getattr(emb.weight, "ds_numel", emb.weight.numel())
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else next(model.parameters()).dtype
    peak = matmul_peak_flops(accelerator.device, dtype)
    return (2 * n * forward_tokens + 6 * n * train_tokens) / max(seconds, 1e-9) / peak


def peak_mem_gb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    except Exception:
        return math.nan
