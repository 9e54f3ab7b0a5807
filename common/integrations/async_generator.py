"""Asynchronous rollouts: a generator process beside the trainer, the weights it samples with, and the batches it
hands back (algos/async_grpo.py; docs/async.md).

    trainer process                                generator process (spawned; its own copy of the policy)
    ---------------                                --------------------------------------------------------
    mailbox = WeightMailbox(policy, version=n)     for step in n+1, n+2, ...:
    gen = GeneratorProcess(target, ...)                version = mailbox.load_into(model, needed(step))
    for step: batch = gen.get(step)                    batch = sample and score (the script's own code)
              update; mailbox.push(policy, step)       put(batch)          (a bounded queue: at most K+1 ahead)

Two routes for the weights (--weight-sync), one contract. `shm` (WeightMailbox): the trainer copies its trainable
tensors into shared CPU memory (`push`), the generator copies them out into its model (`load_into`), both under one
lock, so a sample never sees half a push; on GPUs that is a device-to-host and a host-to-device copy per push.
`broadcast` (BroadcastMailbox): the trainer copies them into a staging buffer on its own device and a collective
broadcast in a process group of two (the trainer and its generator: NCCL between two GPUs, gloo on CPU) sends them
straight into the generator's device, the route vLLM's and TRL's weight updates take (docs/async.md). Either way
the push of version v waits until the generator has loaded version v-1 when a batch still needs it (one version is
held): every batch is sampled by exactly the version its step asks for, whatever the timing, so a run is
reproducible (and resumable exactly).

Every wait is bounded: a generator that raised, died (out of memory: killed) or stopped answering ends the run
with one line (`GeneratorFailed`), never a hang."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

from common.core import models as M
from common.core.data import Sampler
from common.core.errors import UserError
from common.core.sampling import Rollout
from common.core.seeds import seed_everything
from common.integrations.engines import make_engine
from common.integrations.inputs import rl_inputs
from common.integrations.weight_mailbox import GeneratorFailed
from common.parallel.accelerator import make_accelerator

# variables that would make the generator join the trainer's process group (torchrun / accelerate launch set them)
_PROCESS_GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def generator_env(trainer_device: torch.device, generator_device: str, route: str) -> dict:
    """The generator process's CUDA_VISIBLE_DEVICES: its --generator-device ("": the trainer's own device; "+N": N
    GPUs after it, so DDP rank r's generator is on GPU r + N; "cuda:N", counted in the trainer's visible devices;
    "cpu"), so each DDP rank's generator sits where it is told, not on the first GPU. The broadcast route over NCCL
    needs two GPUs (one process per device): refused on one."""
    from common.core.errors import UserError

    if trainer_device.type != "cuda":
        if generator_device not in ("", "cpu"):
            raise UserError(f"--generator-device {generator_device}: the trainer runs on {trainer_device.type}; "
                            "the generator can only use the CPU here")  # fmt: skip
        return {}
    if generator_device == "cpu":
        if route == "broadcast":
            raise UserError("--weight-sync broadcast with --generator-device cpu: NCCL sends GPU to GPU; use "
                            "--weight-sync shm")  # fmt: skip
        return {"CUDA_VISIBLE_DEVICES": ""}
    here, spec = trainer_device.index or 0, generator_device.removeprefix("cuda")
    try:  # "" / "cuda": the trainer's GPU; "+N": N after it; "cuda:N" / ":N": GPU N
        index = here + int(spec[1:] or 0) if spec in ("", "+") or spec.startswith("+") else int(spec.lstrip(":"))
    except ValueError:
        raise UserError(f"--generator-device {generator_device}: expected cpu, cuda:N or +N") from None
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if index >= (len(visible) if visible else torch.cuda.device_count()):
        raise UserError(f"--generator-device {generator_device}: no such GPU here")
    if route == "broadcast" and index == here:
        raise UserError("--weight-sync broadcast puts the generator on the trainer's own GPU: NCCL needs one process "
                        "per GPU; give it another with --generator-device cuda:N, or use --weight-sync shm")  # fmt: skip
    return {"CUDA_VISIBLE_DEVICES": visible[index] if visible else str(index)}


def _spooled(spool: str, batch) -> str:
    """A batch written whole to a file in `spool` (then renamed into place); its path is what the queue carries. A
    message of a few bytes goes through the queue's pipe in one write; a batch of megabytes would not, and a writer
    stopped (SIGSTOP) midway would leave the trainer's read of the rest blocked for good, past --generator-timeout."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=spool, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(batch, f)
    os.replace(tmp, tmp[:-4] + ".pkl")
    return tmp[:-4] + ".pkl"


def _generator_entry(target, out, threads, env, kwargs, spool):
    """The generator process: a process of its own (no process group), `threads` torch threads, then
    target(put=..., **kwargs); its exception, if any, goes back to the trainer as text. Ctrl-C and SIGTERM are the
    trainer's to handle (it checkpoints, then stops this process); a trainer that vanished ends it too: at once on
    Linux (PR_SET_PDEATHSIG: its reward workers and sandboxes have theirs), else within 2 s."""
    import ctypes
    import multiprocessing
    import signal
    import threading

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed with the trainer (even by SIGKILL)
    parent = multiprocessing.parent_process()

    def orphaned():
        while parent.is_alive():
            time.sleep(2.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    for k in _PROCESS_GROUP_VARS:
        os.environ.pop(k, None)
    os.environ.update(env)
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        put = lambda batch: out.put(("ready",) if batch is None else ("batch", _spooled(spool, batch)))  # None: set up
        target(put=put, **kwargs)
        out.put(("done", None))
    except BaseException as e:  # noqa: BLE001 -- everything goes back to the trainer, which decides
        out.put(("error", f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__,
                 traceback.format_exc()))  # fmt: skip


class GeneratorProcess:
    """A spawned process running `target(put, **kwargs)`, which calls put(batch) once per batch, in order. The
    queue holds `max_ahead` finished batches at most (its put blocks beyond). `get` returns the next batch or raises
    GeneratorFailed: the target raised (its message), the process died (its exit code), or nothing came for
    `timeout` seconds (the process is then killed). The clock starts when the target calls put(None), "set up"
    (imports, model and engine loaded: minutes for a large model on a busy machine); before that it allows
    max(timeout, STARTUP_S)."""

    STARTUP_S = 900.0

    def __init__(self, target, kwargs: dict, max_ahead: int, threads: int, timeout: float, env: dict | None = None):
        self.ctx = self.context()
        self.kwargs, self.max_ahead, self.threads, self.timeout = kwargs, max_ahead, threads, timeout
        self.target, self.env, self.proc, self.waited_s, self.ready = target, dict(env or {}), None, 0.0, False

    def start(self, **more) -> None:
        self.queue, self.ready = self.ctx.Queue(maxsize=self.max_ahead), False
        kwargs = {**self.kwargs, **more}
        # not a daemon: the generator may start processes of its own (the reward functions' pool); stopped at exit,
        # whatever ends the trainer (multiprocessing would otherwise wait for it)
        import tempfile

        self.spool = tempfile.mkdtemp(prefix="cleanrlhf-batches-")  # the batches' files (_spooled)
        self.proc = self.ctx.Process(target=_generator_entry,
                                     args=(self.target, self.queue, self.threads, self.env, kwargs, self.spool))  # fmt: skip
        self.proc.start()
        atexit.register(self.stop)

    @staticmethod
    def context():
        """The processes' start method: spawn (a fork after torch started its threads is unsafe)."""
        import torch.multiprocessing as mp

        return mp.get_context("spawn")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def get(self, what: str = "the next batch"):
        t0 = time.time()
        while True:
            try:
                kind, *payload = self.queue.get(timeout=1.0)
                if kind == "ready":  # set up: from now on, --generator-timeout per batch
                    self.ready, t0 = True, time.time()
                    continue
                break
            except queue.Empty:
                if not self.alive():
                    code = self.proc.exitcode
                    why = " (killed: out of memory?)" if code == -9 else ""
                    raise GeneratorFailed(f"the generator process died with exit code {code}{why}") from None
                limit = self.timeout if self.ready else max(self.timeout, self.STARTUP_S)
                if time.time() - t0 > limit:
                    self.stop()
                    what_ = "no batch from the generator" if self.ready else "the generator not set up"
                    raise GeneratorFailed(f"{what_} in {limit:g} s (--generator-timeout)")
        self.waited_s += time.time() - t0
        if kind == "error":
            raise GeneratorFailed(f"the generator raised {payload[0]}\n{payload[1]}")
        if kind == "done":
            raise GeneratorFailed(f"the generator finished before {what}")
        with open(payload[0], "rb") as f:
            batch = pickle.load(f)
        os.unlink(payload[0])
        return batch

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.proc = None
        atexit.unregister(self.stop)
        if getattr(self, "spool", None):
            import shutil

            shutil.rmtree(self.spool, ignore_errors=True)
        # the queue's and the mailbox's semaphores: freed now, not at exit (else a "leaked semaphore" warning)
        self.queue, self.kwargs = None, {}


class GeneratorSetup(NamedTuple):
    """What a generator process samples with (generator_setup)."""

    accelerator: object  # one process, no group; the trainer's --mixed-precision
    tok: object  # the prompt tokenizer
    reward: object  # --reward's scorers
    train_rows: list  # the prompts
    episodes: object  # --env's episode runner, else None
    sampler: Sampler  # the trainer's prompt draw
    policy: object  # the starting weights, on its device: the mailbox loads each version into it
    engine: object  # --rollout-engine (None: hf), seeded seed + rank


def generator_setup(model, data, rewards, gen, env, seed: int, rank: int, sampler_state: dict) -> GeneratorSetup:
    """A generator process's own copy of what the trainer's main() sets up from the same flag groups (the script's
    ModelArgs, PromptArgs, RewardArgs, GenerationArgs, EnvArgs); its sampler continues from `sampler_state`."""
    accelerator = make_accelerator(model)  # the trainer's --mixed-precision
    seed_everything(seed)
    quiet = lambda *a, **k: None  # the trainer said it all
    max_len, tok, reward, train_rows, _, episodes = rl_inputs(model, data, rewards, gen, env, accelerator, quiet)
    sampler = Sampler(len(train_rows), seed)
    sampler.load_state_dict(sampler_state)
    policy = M.load_causal_lm(model.model_name_or_path, tok, **M.train_kwargs(model)).to(accelerator.device)
    engine = make_engine(gen, model, tok, policy, accelerator, max_len, seed + rank)
    return GeneratorSetup(accelerator, tok, reward, train_rows, episodes, sampler, policy, engine)


def serve_batches(put, sample_batch, version_of, mailbox, setup, first_step: int, total_steps: int, timeout: float):
    """A generator process's loop after its `setup` (generator_setup; put(None): the trainer's --generator-timeout
    clock starts): for each step from `first_step`, load the weights of version version_of(step) into its policy
    (waiting for the trainer's push), sample_batch(step) -> (Rollout, resampling rounds, groups filled), and put() the
    batch with its step, version, prompt ids (train_rows' indices), the prompt sampler's state after it, the seconds
    it waited for the weights and sampled, and the reward's error count."""
    policy, sampler, reward = setup.policy, setup.sampler, setup.reward
    index, version = {id(x): i for i, x in enumerate(setup.train_rows)}, None
    put(None)
    for step in range(first_step, total_steps + 1):
        t_wait = time.time()
        version = mailbox.load_into(policy, version_of(step), step, version, timeout)
        t_gen = time.time()
        rollout, rounds, n_filled = sample_batch(step)
        put(dict(rollout=rollout, prompt_ids=[index[id(x)] for x in rollout.rows], step=step, version=version,
                 rounds=rounds, n_filled=n_filled, sampler=sampler.state_dict(), wait_s=t_gen - t_wait,
                 gen_s=time.time() - t_gen, reward_counts=reward.counts()))  # fmt: skip


def split_threads(max_off_policy_steps: int, generator_threads: int) -> tuple[int, int]:
    """(trainer threads, generator threads). -1: synchronous (K = 0: one side waits while the other works) each side
    uses every core; asynchronous, half each (the two sides run at once: more threads than cores slows both). The
    cores are torch's thread budget (OMP_NUM_THREADS where set, else the cores torch uses), not the machine's: with
    OMP_NUM_THREADS=1, K = 0 samples on one thread as grpo_llm.py does, and so draws the same tokens."""
    cores = torch.get_num_threads()
    if generator_threads < 0:
        generator_threads = cores if max_off_policy_steps == 0 else max(1, cores // 2)
    trainer = cores if max_off_policy_steps == 0 else max(1, cores - generator_threads)
    return trainer, generator_threads


class BatchStream:
    """The batches of the coming steps, in order: from the generator process, or restored from a checkpoint.

    Checkpoint state (an object with state_dict, saved under the script's key): the batches of the next
    `ahead` = K steps. They were sampled by versions older than the checkpoint's weights, which a resumed run could
    not sample with again; kept, the resumed run trains on exactly what the uninterrupted one did. A batch (a dict:
    its Rollout, prompt ids, version, ...) is saved with its Rollout as a dict and without rows (rebuilt from the
    prompt ids and `train_rows`): trainer_state.pt holds tensors, numbers and strings only (loaded with
    weights_only)."""

    def __init__(self, accelerator, ahead: int, total_steps: int, train_rows):
        self.acc, self.ahead, self.total, self.train_rows = accelerator, ahead, total_steps, train_rows
        self.ready, self.gen, self.next_step, self.failed = {}, None, 1, None

    def start(self, gen: GeneratorProcess, next_step: int, sampler_state: dict) -> None:
        """Start `gen` at the first step not already held, drawing prompts after the last batch held."""
        self.gen, self.next_step = gen, next_step
        first = next_step + len(self.ready)
        gen.start(first_step=first, sampler_state=self.ready[first - 1]["sampler"] if self.ready else sampler_state)

    def next(self, step: int) -> dict:
        batch = self.ready.pop(step) if step in self.ready else self.gen.get(f"the batch of step {step}")
        if batch["step"] != step:  # a bug, never a user's error: batches come in order
            raise RuntimeError(f"expected the batch of step {step}, got step {batch['step']}'s")
        self.next_step = step + 1
        return batch

    def state_dict(self) -> dict:
        for s in range(self.next_step, min(self.next_step + self.ahead, self.total + 1)):
            if s not in self.ready and self.failed is None:
                try:
                    self.ready[s] = self.gen.get(f"the batch of step {s}")
                except GeneratorFailed as e:  # saved without it: resumed, it is sampled again
                    self.failed = e
        mine = {s: dict(b, rollout=saved_rollout(b["rollout"])) for s, b in self.ready.items()}
        if self.acc.num_processes == 1:
            return {"ranks": [mine]}
        everyone = [None] * self.acc.num_processes
        torch.distributed.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    def load_state_dict(self, state: dict) -> None:
        mine = state["ranks"][self.acc.process_index]
        self.ready = {s: loaded_batch(b, self.train_rows) for s, b in mine.items()}


def saved_rollout(rollout) -> dict:
    """A batch's Rollout as trainer_state.pt holds it: its fields but the rows (rebuilt from the prompt ids) and the
    prompt cache; tensors, lists of strings and a dict of tensors."""
    return {k: v for k, v in vars(rollout).items() if k not in ("rows", "prompt_cache")}


def loaded_batch(batch: dict, train_rows) -> dict:
    """A batch from a checkpoint, its Rollout rebuilt. Checkpoints written before the Rollout (2026-12-05) hold its
    fields flat in the batch (and no `is_eos`, which nothing after sampling reads: taken as "not truncated")."""
    b = dict(batch)
    if "rollout" not in b:
        flat = ("texts", "queries", "query_mask", "responses", "mask", "logprobs", "truncated", "scores", "solved")
        fields = {k: b.pop(k) for k in flat} | {"is_eos": ~batch["truncated"]}
        b["rollout"] = dict(fields, logged={k: b.pop(k) for k in list(b) if "/" in k})
    b["rollout"] = Rollout(rows=[train_rows[i] for i in b["prompt_ids"]], **b["rollout"])
    return b


class BatchLog:
    """batches.jsonl in the run folder: per step, the version that sampled its batch, its staleness and the prompt
    ids it trained on (all processes'), so a run can show every prompt was consumed once; staleness.json, the
    histogram {staleness: batches}. Resumed: the lines past the checkpoint's step are dropped (they are redone)."""

    def __init__(self, accelerator, run_dir: Path, start_step: int):
        self.acc, self.path, self.counts = accelerator, Path(run_dir) / "batches.jsonl", {}
        if accelerator.is_main_process:
            old = [json.loads(x) for x in self.path.read_text().splitlines()] if self.path.exists() else []
            kept = [r for r in old if r["step"] <= start_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            for r in kept:
                self.counts[r["staleness"]] = self.counts.get(r["staleness"], 0) + 1

    def add(self, step: int, batch: dict) -> int:
        """Logs step `step`'s batch (its version, prompt ids) and returns its staleness, step - 1 - version: the
        updates between the policy that sampled it and the one it trains. Every process calls it (ids gathered)."""
        version, prompt_ids = batch["version"], batch["prompt_ids"]
        staleness = step - 1 - version
        self.counts[staleness] = self.counts.get(staleness, 0) + 1
        ids = sorted(set(prompt_ids))  # a prompt's G samples: one id
        if self.acc.num_processes > 1:
            everyone = [None] * self.acc.num_processes
            torch.distributed.all_gather_object(everyone, ids)
            ids = [i for part in everyone for i in part]
        if self.acc.is_main_process:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps({"step": step, "version": version, "staleness": staleness, "prompt_ids": ids}) + "\n"
                )
            hist = {str(k): v for k, v in sorted(self.counts.items())}
            (self.path.parent / "staleness.json").write_text(json.dumps(hist) + "\n")
        return staleness


def async_launch(accelerator, dynamic_sampling: bool, max_off_policy_steps: int, generator_threads: int, gen,
                 generator_device: str, route: str) -> tuple[int, dict]:  # fmt: skip
    """async_grpo.py's checks and threads, before its run folder exists: it runs in one process or under DDP (a push
    takes each trainer process's whole weights), dynamic sampling in one process only (each generator would resample
    on its own), one generator per vLLM server (GenerationArgs `gen`), a --generator-device this machine has. Sets
    this process's torch threads; returns the generator's (split_threads) and its environment (generator_env)."""
    if str(accelerator.distributed_type).split(".")[-1] not in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU"):
        raise UserError(f"async_grpo.py runs one process or DDP, not {accelerator.distributed_type}: a push takes "
                        "the policy's whole weights from each trainer process (docs/async.md)")  # fmt: skip
    if dynamic_sampling and accelerator.num_processes > 1:
        raise UserError("--dynamic-sampling with several processes: each generator would resample on its own")
    if (
        gen.rollout_engine == "vllm-server"
        and accelerator.num_processes > 1
        and (gen.vllm_server_url or gen.vllm_server_port)
    ):
        # each process's generator pushes its own versions: on one server they would overwrite each other's mid-batch
        raise UserError("async_grpo.py --rollout-engine vllm-server with several processes: each process's generator "
                        "needs its own server (leave --vllm-server-url and --vllm-server-port empty: each starts one)")  # fmt: skip
    env = generator_env(accelerator.device, generator_device, route)
    trainer_threads, generator_threads = split_threads(max_off_policy_steps, generator_threads)
    torch.set_num_threads(trainer_threads)
    return generator_threads, env


@contextlib.contextmanager
def ending_on_failure(accelerator, run, batches: BatchStream, generator: GeneratorProcess, step: int):
    """Around a step's push and its batch's intake: a GeneratorFailed on any process (every process asks, so all
    leave together) ends the run by end_on_failure: a checkpoint, one line, exit 1."""
    failed = None
    try:
        yield
    except GeneratorFailed as e:
        failed = e
    if accelerator.reduce(torch.tensor([float(failed is not None)], device=accelerator.device), "max").item():
        end_on_failure(accelerator, run, batches, generator, step, failed)


def end_on_failure(accelerator, run, batches: BatchStream, generator: GeneratorProcess, step: int, failed) -> None:
    """A generator failed (on this or another process, all agree): stop it, checkpoint the last step trained unless
    it is saved already, say so in one line (the generator's traceback in the run folder), exit 1."""
    generator.stop()
    batches.failed = batches.failed or failed or GeneratorFailed("another process's generator failed")
    last, saved = step - 1, ""
    if last > run.start_step and not (run.dir / "checkpoints" / f"step_{last}").exists():
        run.checkpoint(last)
    if last > 0 and (run.dir / "checkpoints" / f"step_{last}").exists():
        saved = f"; checkpoint at step {last}, resume with --resume {run.dir}"
    if failed is not None:
        head, _, trace = str(failed).partition("\n")
        if trace:
            (run.dir / f"generator_error_rank{accelerator.process_index}.txt").write_text(trace)
            head += f" (traceback: {run.dir}/generator_error_rank{accelerator.process_index}.txt)"
        print(f"[cleanrlhf] step {step}: {head}{saved}", file=sys.stderr, flush=True)
    accelerator.wait_for_everyone()
    raise SystemExit(1)
