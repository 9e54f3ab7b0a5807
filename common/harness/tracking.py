"""The run folder and its records: resume resolution (`resolve_resume`), the folder and its lock, the code that
ran, metrics.jsonl / samples.jsonl and W&B, TensorBoard or MLflow (`Tracker`, `open_tracker`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common.core.errors import UserError, user_error
from common.harness.checkpoint import (
    checkpoint_record,
    damage,
    earlier_intact,
    list_checkpoints,
    remove_stale_temp_checkpoints,
    resolve_checkpoint,
    run_id_of,
    step_of,
)
from common.harness.flags import flat_args, resume_may_change, runtime_values

REPO = Path(__file__).resolve().parents[2]  # the project folder (common/harness/ -> ..)


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
    step, and flags that differ from the run's args.json other than those marked RESUME_MAY_CHANGE (common.harness.args:
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
