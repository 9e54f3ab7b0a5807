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

import os
import sys
import time
from pathlib import Path

import torch

from common.core.errors import UserError, user_error
from common.harness.args import ModelArgs
from common.harness.checkpoint import BestKeeper, is_sharded, load_weights, restore_checkpoint, save_checkpoint
from common.harness.health import HealthConfig, HealthMonitor
from common.harness.tracking import _CURRENT, Tracker, keep_code, make_run_dir, resolve_resume
from common.parallel.accelerator import is_deepspeed


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


def end_on_engine_failure(e: Exception) -> None:
    """A rollout server failed mid-run (common.core.errors.EngineFailed): checkpoint what was trained, if anything is
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
    module = sys.modules.get("common.integrations.vllm_server")
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
            if run.should_log(step):                   # --log-every, evaluation steps, the last step
                run.log(step, metrics, samples)     # + evaluation when due, health warnings, the best checkpoint
        run.end()

    `models` = {name: model} are saved as folders, `optimizers` = {key: (model name, optimizer)} and `state` =
    {key: object with state_dict()} into trainer_state.pt; the run adds its own `best` (--save-best) and, when
    Args has `health`, `health` (the training-health monitor). `evaluate()` returns metrics or (metrics, samples)."""

    def __init__(self, accelerator, args, algo: str):
        self.accelerator, self.args, self.algo, self.log_line = accelerator, args, algo, accelerator.print
        self.ckpt = resolve_resume(args, algo)  # None: a fresh run
        self.cfg = args.run  # the run's own flags (common.harness.args.RunArgs)
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

    def should_log(self, step: int) -> bool:
        """Metrics are due: every --log-every steps, and always at an evaluation and the last step."""
        return step % self.cfg.log_every == 0 or self.last(step) or self.evaluating(step)

    logging = should_log  # the name before 2026-12 (users' copies of the scripts)

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
