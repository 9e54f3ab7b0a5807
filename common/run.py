"""The run's life, shared by every script (`Run`, at the bottom): resume resolution and its flag guard, the
run folder, metrics and W&B tracking, stop signals, checkpoint cadence, evaluation cadence.

Run folder: runs/{algo}__{exp_name}__{seed}__{unix_time}/
    args.json        every Args field, world_size, distributed_type, git commit/dirty, library versions
    metrics.jsonl    one JSON object per logged step
    samples.jsonl    a few (prompt, response, reward) rows per log interval
    code/{script}.py the script that ran, as it was (W&B's save_code): an edited copy stays with its results
    checkpoints/step_{N}/   save_pretrained folders + trainer_state.pt
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.args import ModelArgs, flat_args, resume_may_change, runtime_values
from common.checkpoint import (
    BestKeeper,
    checkpoint_record,
    damage,
    earlier_intact,
    is_sharded,
    list_checkpoints,
    load_weights,
    remove_stale_temp_checkpoints,
    resolve_checkpoint,
    restore_checkpoint,
    run_id_of,
    save_checkpoint,
    step_of,
)
from common.distributed import is_deepspeed
from common.errors import UserError, user_error
from common.health import HealthConfig, HealthMonitor

REPO = Path(__file__).resolve().parents[1]


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
        # what every rank agrees on; a signal that lands after `flag` was read (while this runs) is kept for the
        # next step's call, never overwritten: the CI run that lost a SIGTERM this way exited 0 at --total-steps
        agreed = int(flag.item()) or None
        self.signum = self.signum or agreed
        return agreed is not None

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


def resolve_resume(args, algo: str) -> Path | None:
    """The checkpoint `--resume` names, checked before anything loads; None for a fresh run.

    `--resume PATH`: a checkpoint folder, or a run folder (its latest complete checkpoint).
    `--resume auto`: the latest checkpoint of the newest run `{algo}__{exp_name}__{seed}__*` under
    --output-dir, or a fresh start when there is none (what cluster job scripts want).
    Refused, with the reason: another algorithm's checkpoint, --total-steps not past the checkpoint's
    step, and flags that differ from the run's args.json other than those marked RESUME_MAY_CHANGE (common.args:
    how long the run goes and how it logs, evaluates and saves; any other difference would change the optimizer or
    the stream of samples under the restored state)."""
    r = args.run
    if not r.resume:
        return None
    if r.resume == "auto":
        runs = sorted(Path(r.output_dir).glob(f"{algo}__{r.exp_name}__{r.seed}__*"), key=lambda p: p.stat().st_mtime)
        runs = [r for r in runs if list_checkpoints(r)]
        if not runs:
            return None
        ckpt = resolve_checkpoint(str(runs[-1]))
        while damage(ckpt) is not None:  # auto: the newest checkpoint of the run that looks whole
            earlier = [c for c in list_checkpoints(ckpt.parent.parent) if step_of(c) < step_of(ckpt)]
            if not earlier:
                user_error(f"--resume auto: {damage(ckpt)}; no earlier checkpoint of {ckpt.parent.parent} is whole")
            print(f"[cleanrlhf] --resume auto: {damage(ckpt)}; trying the checkpoint before it", file=sys.stderr)
            ckpt = max(earlier, key=step_of)
    else:
        try:
            ckpt = resolve_checkpoint(r.resume)
        except FileNotFoundError as e:
            user_error(str(e))
        if damage(ckpt) is not None:
            user_error(f"--resume {r.resume}: {damage(ckpt)}{earlier_intact(ckpt)}")
    run_dir = ckpt.parent.parent
    theirs = run_dir.name.split("__")[0]
    if theirs != algo:
        user_error(f"--resume {r.resume}: that is a {theirs} checkpoint; {algo} cannot continue it")
    step = step_of(ckpt)
    if r.total_steps <= step:
        user_error(
            f"--resume {r.resume}: the checkpoint is at step {step}; --total-steps {r.total_steps} "
            f"must be larger to continue"
        )
    # a step folder that is a symlink to, or a copy of, another run's checkpoint would load that run's state into
    # this folder and overwrite its later checkpoints: refused (the checkpoint carries its run's identity)
    if ckpt.is_symlink():
        user_error(f"--resume {r.resume}: {ckpt} is a link to {ckpt.resolve()}, another run's checkpoint; resume "
                   f"that run, or start a new one from {ckpt.resolve()}/<model> with --model-name-or-path")  # fmt: skip
    record, recorded = checkpoint_record(ckpt), run_dir / "args.json"
    if record.get("run_id") and record["run_id"] != run_id_of(run_dir):
        user_error(f"--resume {r.resume}: {ckpt.name} was written by run {record['run_id']}, not by "
                   f"{run_id_of(run_dir)} (a checkpoint copied from another run folder); resume its own run")  # fmt: skip
    if recorded.exists() or record.get("args"):  # args.json deleted: the checkpoint's own record of the flags
        before = read_args_json(recorded) if recorded.exists() else record["args"]
        recorded = recorded if recorded.exists() else ckpt / "checkpoint.json"
        now, may_change = flat_args(args), resume_may_change(args)
        changed = {k: (before[k], v) for k, v in now.items() if k in before and before[k] != v and k not in may_change}
        if changed:
            lines = "; ".join(f"--{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
            user_error(
                f"--resume {r.resume}: these flags differ from the run being resumed ({lines}). "
                f"Pass the run's own values (see {recorded}), or start a new run from "
                f"{ckpt}/<model> with --model-name-or-path"
            )
    return ckpt


def read_args_json(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        user_error(f"{path}: damaged ({type(e).__name__}: {e}); the flags of the run being resumed cannot be checked")
    if not isinstance(record, dict):
        user_error(f"{path}: damaged (not a JSON object); the flags of the run being resumed cannot be checked")
    return record


_HELD_LOCKS: list = []  # this process's run-folder locks, held open until it exits


def lock_run_dir(run_dir: Path) -> None:
    """Hold an exclusive lock on run_dir/.lock for the life of this process (the main one): two processes
    continuing one run folder would write its steps twice into metrics.jsonl and overwrite each other's
    checkpoints. The lock goes with the process, also on a crash or kill -9 (flock)."""
    import fcntl

    f = open(Path(run_dir) / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"{run_dir}: in use by {holder}; one run folder takes one run at a time") from None
    f.seek(0), f.truncate(), f.write(f"pid {os.getpid()}\n"), f.flush()
    _HELD_LOCKS.append(f)


def make_run_dir(accelerator, algo: str, args, resume_from: Path | None = None) -> Path:
    """The run folder: a new one, named once on the main process (its clock) and shared with every
    rank; or, when resuming, the checkpoint's own run folder, continued in place: its metrics and
    samples after the checkpoint's step are dropped (a crash between checkpoints left rows that will
    be recomputed) and args.json records the resume (time, step, flags changed)."""
    from accelerate.utils import broadcast_object_list

    if resume_from is not None:
        run_dir = Path(resume_from).parent.parent
        if accelerator.is_main_process:
            lock_run_dir(run_dir)  # before its files are touched: a second resume of the same run stops here
            step = step_of(Path(resume_from))
            stale = remove_stale_temp_checkpoints(run_dir)
            if stale:
                accelerator.print(f"[cleanrlhf] removed half-written checkpoint folders from a crash: {stale}")
            for name in ("metrics.jsonl", "samples.jsonl"):
                _drop_rows_after(run_dir / name, step, accelerator.print)
            record = read_args_json(run_dir / "args.json") if (run_dir / "args.json").exists() else {}
            now = flat_args(args)
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
            record.setdefault("run_id", checkpoint_record(Path(resume_from)).get("run_id") or run_dir.name)
            _write_atomic(run_dir / "args.json", json.dumps(record, indent=2, default=str))
        accelerator.wait_for_everyone()
        return run_dir
    name = [None]
    if accelerator.is_main_process:  # two runs started in the same second get different folders
        base = f"{algo}__{args.run.exp_name}__{args.run.seed}__{int(time.time())}"
        Path(args.run.output_dir).mkdir(parents=True, exist_ok=True)
        for k in range(1000):
            candidate = Path(args.run.output_dir) / (base if k == 0 else f"{base}-{k}")
            try:
                candidate.mkdir()
                lock_run_dir(candidate)
                name = [candidate.name]
                break
            except FileExistsError:
                continue
    if accelerator.state.num_processes > 1:  # every process (under --tp-size, more than num_processes)
        broadcast_object_list(name, from_process=0)
    run_dir = Path(args.run.output_dir) / name[0]
    if accelerator.is_main_process:
        record = {
            **flat_args(args),
            "algo": algo,
            "world_size": accelerator.state.num_processes,
            "tp_size": getattr(accelerator, "tp_size", 1),
            **runtime_values(args),  # a script's values filled at run time (init=False fields)
            "mixed_precision_resolved": str(accelerator.mixed_precision),  # what --mixed-precision auto became
            "distributed_type": str(accelerator.distributed_type).split(".")[-1],  # NO, MULTI_GPU, FSDP, DEEPSPEED...
            "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", None),
            "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(_git("status", "--porcelain")),
            "versions": library_versions(),
            "argv": sys.argv,
            "run_id": run_dir.name,  # kept if the folder is renamed; every checkpoint records it (checkpoint.json)
        }
        _write_atomic(run_dir / "args.json", json.dumps(record, indent=2, default=str))
    accelerator.wait_for_everyone()
    return run_dir


def keep_code(accelerator, run_dir: Path, algo: str, start_step: int) -> None:
    """run_dir/code/<script>.py: the script that runs, committed or not (args.json's git commit does not hold an
    edited or untracked copy). A resumed run whose script changed keeps the earlier text beside it
    (<script>.py.before_step_N). Only when the script is the program (`python algos/x.py`, `accelerate launch`), not
    when a test calls main() in-process."""
    main = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "-")
    if not accelerator.is_main_process or main.suffix != ".py" or main.stem != algo:
        return
    dst, text = run_dir / "code" / main.name, main.read_text()
    dst.parent.mkdir(exist_ok=True)
    if dst.exists() and dst.read_text() != text:
        os.replace(dst, dst.with_name(f"{dst.name}.before_step_{start_step}"))
    _write_atomic(dst, text)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def json_rows(path: Path, warn=None) -> list[dict]:
    """The rows of a JSON-lines file (metrics.jsonl, samples.jsonl). A line that does not parse (a crash in the
    middle of a write tears the last one) is skipped, with `warn(message)` naming the file and line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if warn:
                warn(f"[cleanrlhf] {path} line {i}: not a complete JSON row (a write cut short by a crash?); skipped")
    return rows


def _drop_rows_after(path: Path, step: int, warn=None) -> None:
    """Keep the JSON-lines rows of `path` whose step is <= `step` (in place, atomically); torn lines go."""
    if not path.exists():
        return
    keep = [r for r in json_rows(path, warn) if r.get("step", 0) <= step]
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


class Tracker:
    """metrics.jsonl (always), samples.jsonl, W&B (--track), the trackers of --report-to (Accelerate's tracker
    classes: the same metric names and values, the flags as their config), and a rich progress line. Main process
    only."""

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
        self.others = []  # --report-to trackers other than W&B
        if not self.main:
            return
        names = [n for n in args.run.report_to.split(",") if n]
        self.others = [open_tracker(n, args, run_dir, fresh=start_step == 0) for n in names if n != "wandb"]
        if args.run.track or "wandb" in names:
            import wandb

            tags = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
            commit = _git("rev-parse", "--short", "HEAD")
            # id from the folder: a resumed run continues the same W&B run
            self.wandb = wandb.init(
                project=args.run.wandb_project_name,
                entity=args.run.wandb_entity,
                name=run_dir.name,
                id="".join(c if c.isalnum() or c in "_-" else "-" for c in run_dir.name)[:128],
                resume="allow",
                group=args.run.exp_name,
                config=flat_args(args),
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
        for t in self.others:
            t.log({k: v for k, v in row.items() if k != "step" and isinstance(v, float)}, step=step)
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
        for t in self.others:
            t.finish()


def open_tracker(name: str, args, run_dir: Path, fresh: bool):
    """One --report-to tracker (Accelerate's class of that name), started, with the flags as its config on a fresh
    run. TensorBoard writes run_dir/tensorboard/ (a resumed run adds an event file beside the first); MLflow logs to
    MLFLOW_TRACKING_URI, else a file store in the output folder (runs/mlruns: MLFLOW_ALLOW_FILE_STORE is set for
    it), in the experiment --exp-name, and a resumed run continues the same MLflow run (its id kept in
    run_dir/trackers.json); the others take the run folder's name as their run name."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    cls, ids_file = LOGGER_TYPE_TO_CLASS[name], run_dir / "trackers.json"
    ids = json.loads(ids_file.read_text()) if ids_file.exists() else {}
    if name == "tensorboard":
        tracker = cls("tensorboard", run_dir)
    elif name == "mlflow":
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind this
            mlflow.set_tracking_uri(f"file:{(run_dir.parent / 'mlruns').resolve()}")
        tracker = cls(experiment_name=args.run.exp_name, run_id=ids.get("mlflow"), run_name=run_dir.name)
    else:
        tracker = cls(run_dir.name, run_dir) if cls.requires_logging_directory else cls(run_dir.name)
    tracker.start()
    if name == "mlflow" and "mlflow" not in ids:
        _write_atomic(ids_file, json.dumps({**ids, "mlflow": tracker.active_run.info.run_id}))
    if fresh:  # config values as the trackers take them: numbers, strings, booleans; the rest as JSON text
        flat = flat_args(args)
        tracker.store_init_configuration(
            {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in flat.items()}
        )
    return tracker


_CURRENT: list = []  # the Run of this process, once it has begun (an engine failure checkpoints through it)


def end_on_engine_failure(e: Exception) -> None:
    """A rollout server failed mid-run (common.errors.EngineFailed): checkpoint what was trained, if anything is
    unsaved (`Run.save_on_failure`), then the error and how to resume in one line; exit 1. With nothing trained
    (the first step's rollout, say): the one line alone, exit 2 (as a bad flag)."""
    run = _CURRENT[-1] if _CURRENT else None
    saved = run.save_on_failure() if run is not None and run._step else None
    if saved is None:  # nothing trained to save (a server that is not there, or will not start): exit 2, as a bad flag
        user_error(f"error: {e}")
    hint = f"; checkpoint at step {saved}, resume with --resume {run.dir}" if saved else ""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {e}{hint}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _server_engines() -> bool:
    """Whether this process holds a vllm-server engine (async_grpo.py's trainer does not: its generator does)."""
    module = sys.modules.get("common.vllm_server")
    return bool(module and module.LIVE)


class _Saved:
    """A state object's state_dict as it was (`Run.steps` keeps the step's start)."""

    def __init__(self, sd):
        self.sd = sd

    def state_dict(self):
        return self.sd


class Run:
    """The run's life, driven from a script in a few visible lines (the script still says what it saves):

        run = Run(accelerator, args, "ppo_llm")    # --resume resolved and checked before anything loads
        run.load_weights(policy=policy)             # resumed: the checkpoint's weights, before accelerator.prepare
        start_step = run.begin(tok, models, optimizers, state, evaluate)  # restore, run folder, tracker, eval at 0
        for step in run.steps():                    # to --total-steps, --max-wall-minutes, or SIGINT/SIGTERM
            ...                                     # (after each step: periodic/timed/final/signal checkpoints)
            if run.logging(step):                   # --log-every, evaluation steps, the last step
                run.log(step, metrics, samples)     # + evaluation when due, health warnings, the best checkpoint
        run.end()

    `models` = {name: model} are saved as folders, `optimizers` = {key: (model name, optimizer)} and `state` =
    {key: object with state_dict()} into trainer_state.pt; the run adds its own `best` (--save-best) and, when
    Args has `health`, `health` (the training-health monitor). `evaluate()` returns metrics or (metrics, samples)."""

    def __init__(self, accelerator, args, algo: str):
        self.accelerator, self.args, self.algo, self.log_line = accelerator, args, algo, accelerator.print
        self.ckpt = resolve_resume(args, algo)  # None: a fresh run
        self.cfg = args.run  # the run's own flags (common.args.RunArgs)
        self.best = BestKeeper(self.cfg.save_best)
        health = next((v for v in vars(args).values() if isinstance(v, HealthConfig)), None)  # RL scripts' --health.*
        self.health = HealthMonitor(health, self.log_line) if health is not None else None
        self.start_step, self._last, self.evaluate, self._warned_best = 0, None, None, False
        self._step, self._at_start, self._in_log = 0, None, False  # the step under way, its state at its start
        model = next((v for v in vars(args).values() if isinstance(v, ModelArgs)), None)  # the --lora-r group
        if self.cfg.checkpoint_format == "sharded" and ((model and model.lora_r) or is_deepspeed(accelerator)):
            raise UserError("--checkpoint-format sharded: for full fine-tuning under one process, DDP, FSDP2 or TP "
                            "(a LoRA checkpoint is its small adapter; DeepSpeed writes its own shards)")  # fmt: skip

    def load_weights(self, **models) -> None:
        """Resumed: each model's weights from the checkpoint's folder of that name (before prepare); a sharded
        checkpoint's come after prepare, resharded (`begin`)."""
        for name, model in models.items():
            if self.ckpt and not is_sharded(self.ckpt):
                load_weights(model, self.ckpt / name)

    def begin(self, tokenizer, models: dict, optimizers: dict, state: dict, evaluate=None) -> int:
        """Restore the checkpoint's state (resumed), open the run folder (resumed: the same one, continued),
        the tracker and the stop signals, evaluate before the first step (fresh runs). Returns the start step."""
        acc, cfg = self.accelerator, self.cfg
        state = {**state, "best": self.best, **({"health": self.health} if self.health else {})}
        self.tokenizer, self.models, self.optimizers, self.state, self.evaluate = (
            tokenizer, models, optimizers, state, evaluate
        )  # fmt: skip
        if cfg.save_best and cfg.save_best.startswith("eval/") and not (evaluate and cfg.eval_every):
            why = "--eval-every 0" if not cfg.eval_every else "no validation data"
            raise UserError(f"--save-best {cfg.save_best}: this run never evaluates ({why}), so it would never save")
        if self.ckpt:
            self.start_step = restore_checkpoint(acc, self.ckpt, models, state, optimizers)
            self.log_line(f"resumed from {self.ckpt} at step {self.start_step}")
        self.dir = make_run_dir(acc, self.algo, self.args, self.ckpt)
        _CURRENT.append(self)
        os.environ["CLEANRLHF_RUN_DIR"] = str(self.dir)  # (processes started from here: their server's log)
        keep_code(acc, self.dir, self.algo, self.start_step)
        self.tracker = Tracker(acc, self.args, self.dir, cfg.total_steps, self.start_step)
        self.stop = StopSignal(acc)  # --max-wall-minutes counts from here
        self.log_line(f"run folder: {self.dir}")
        if evaluate and cfg.eval_every and self.start_step == 0:
            self.log(0, {})
        return self.start_step

    def steps(self):
        """start_step + 1 .. --total-steps; after each: a checkpoint when --save-every, --save-every-minutes,
        the last step or a signal asks for one; a signal then exits (non-zero, with the resume command)."""
        cfg = self.cfg
        import copy

        for step in range(self.start_step + 1, cfg.total_steps + 1):
            self._last = None
            # the small state objects as the step starts (sampler, schedule, ...): a rollout server failing in the
            # step's rollout (before its update) is saved as the previous step, exactly (`save_on_failure`)
            self._step, self._in_log = step, False
            if _server_engines():  # this process samples from a server that may fail mid-step
                self._at_start = {
                    k: copy.deepcopy(v.state_dict()) for k, v in self.state.items() if hasattr(v, "state_dict")
                }
            yield step
            last = self.last(step)
            stopping = self.stop.requested()  # SIGINT / SIGTERM on any rank: checkpoint this step, then exit
            due = self.stop.save_due(cfg.save_every_minutes)
            if (cfg.save_every and step % cfg.save_every == 0) or last or stopping or due:
                self.checkpoint(step)
            if stopping:
                self.stop.exit(self.dir, step)
            if last:
                break

    def last(self, step: int) -> bool:
        """--total-steps reached, or --max-wall-minutes passed (decided once per step, alike on every rank)."""
        if self._last is None:
            self._last = step == self.cfg.total_steps or self.stop.out_of_time(self.cfg.max_wall_minutes)
        return self._last

    def evaluating(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(self.evaluate and every and (step == 0 or step % every == 0 or self.last(step)))

    def logging(self, step: int) -> bool:
        """Metrics are due: every --log-every steps, and always at an evaluation and the last step."""
        return step % self.cfg.log_every == 0 or self.last(step) or self.evaluating(step)

    def log(self, step: int, metrics: dict, samples: list[dict] = ()) -> None:
        """One metrics row (evaluated first when due; health warnings added), the best checkpoint when
        --save-best improved, and up to --num-samples-logged samples (eval ones tagged split=eval)."""
        n = self.cfg.num_samples_logged
        if self.evaluating(step):
            self._in_log = True  # the step's update is done: a failure here saves this step
            out = self.evaluate()
            eval_metrics, eval_samples = out if isinstance(out, tuple) else (out, [])
            metrics = {**metrics, **eval_metrics}
            self.tracker.samples(step, [{**s, "split": "eval"} for s in eval_samples[:n]])
        if self.health is not None:
            metrics = {**metrics, **self.health.check(metrics)}
        self.tracker.log(step, metrics)
        wanted = self.cfg.save_best
        if wanted and wanted not in metrics and step > 0 and (self.evaluating(step) or not wanted.startswith("eval/")):
            if not self._warned_best:  # once: an unknown metric name would otherwise never save, silently
                self.log_line(
                    f"[cleanrlhf] --save-best {wanted}: not a metric of this run ({', '.join(sorted(metrics))})"
                )
            self._warned_best = True
        if step > 0 and self.best.improved(metrics):
            self.checkpoint(step, "best")
        self.tracker.samples(step, list(samples)[:n])

    def checkpoint(self, step: int, label: str | None = None) -> None:
        cfg = self.cfg
        save_checkpoint(
            self.accelerator, self.dir, step, self.models, self.state, cfg.keep_last, tokenizer=self.tokenizer,
            args=self.args, save_merged=cfg.save_merged, label=label, optimizers=self.optimizers,
            sharded=cfg.checkpoint_format == "sharded",
        )  # fmt: skip

    def save_on_failure(self) -> int | None:
        """After a rollout engine failed: checkpoint the last step trained unless saved. During a step's rollout
        (before its update) that is the previous step, with the state objects as the step began; during its
        evaluation, the step itself. Returns the step saved (or found saved), None when nothing was trained."""
        step = self._step if self._in_log else self._step - 1
        if step <= 0:
            return None
        if not (self.dir / "checkpoints" / f"step_{step}").exists():
            if step <= self.start_step:
                return None
            if not self._in_log:
                self.state = {**self.state, **{k: _Saved(v) for k, v in (self._at_start or {}).items()}}
            self.checkpoint(step)
        return step

    def end(self) -> Path:
        if self in _CURRENT:
            _CURRENT.remove(self)
        self.tracker.close()
        self.log_line(f"done: {self.dir}")
        return self.dir
