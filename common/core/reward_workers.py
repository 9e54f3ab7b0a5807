"""Running reward functions safely: a per-call timeout (`call_with_timeout`) and the `--reward-workers` process
pool (`RewardPool`: a hung or crashing function costs its row, not the run; memory per worker checked).
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import torch

from common.core.errors import UserError
from common.core.scorers import load_reward_fn


class RewardTimeout(Exception):
    pass


_WAKE_ARMED: list = []  # set by the watchdog when a reward function ran past its timeout with SIGALRM ignored


def _wake(signum, frame):
    if _WAKE_ARMED:
        _WAKE_ARMED.clear()
        raise RewardTimeout("SIGALRM ignored")


def call_with_timeout(fn, seconds: float, *args):
    """fn(*args), or RewardTimeout after `seconds` of wall time: a SIGALRM timer first; a function that ignores
    or replaces SIGALRM is stopped 1 s later by a watchdog thread that signals the main thread with a real-time
    signal of our own (SIGRTMIN+3, not SIGUSR1/2, which schedulers send), whose handler raises RewardTimeout
    there: a busy Python loop or a sleep is interrupted. Main thread only; code inside a C extension that never
    returns to Python is not interrupted in this process (a pool worker's is: the pool kills the worker)."""
    import signal
    import threading

    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return fn(*args)

    def expired(signum, frame):
        raise RewardTimeout(f"no result after {seconds:g} s (--reward-timeout)")

    wake = getattr(signal, "SIGRTMIN", None)
    lock, done, main = threading.Lock(), threading.Event(), threading.main_thread().ident
    if wake is not None:
        wake += 3
        if signal.getsignal(wake) is not _wake:
            signal.signal(wake, _wake)

        def watchdog():
            if not done.wait(seconds + 1):
                with lock:
                    if not done.is_set():  # still inside fn: SIGALRM did not stop it
                        _WAKE_ARMED.append(True)
                        signal.pthread_kill(main, wake)

        threading.Thread(target=watchdog, daemon=True).start()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        out = fn(*args)
        with lock:
            done.set()
        return out
    except RewardTimeout as e:
        reason = "" if "ignored" not in str(e) else "; the function ignores SIGALRM"
        raise RewardTimeout(f"no result after {seconds:g} s (--reward-timeout{reason})") from None
    finally:
        with lock:
            done.set()
            _WAKE_ARMED.clear()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RewardError(UserError):
    """A reward function failed on a row (the message names it); a UserError: one line, exit 2."""


def score_row(fns, timeout: float, data_source, response, ground_truth, extra_info) -> list[tuple[bool, object]]:
    """Each function's raw output, (True, out), or the failure as text, (False, repr(exception)).
    The same code runs in the trainer (--reward-workers 0) and in a pool worker."""
    outs = []
    for fn in fns:
        try:
            outs.append((True, call_with_timeout(fn, timeout, data_source, response, ground_truth, extra_info)))
        except BaseException as e:  # any failure of user code is data for the caller, not a crash here: a
            # sys.exit() or a KeyboardInterrupt raised inside a reward function is that function failing, not a
            # request to stop training (a real Ctrl-C reaches the trainer's StopSignal, never a reward function)
            outs.append((False, repr(e)))
    return outs


_WORKER_FNS: list = []


def _init_worker(specs: list[str]) -> None:
    """Pool worker start-up: one thread (the trainer owns the cores), the functions imported once; Ctrl-C ignored
    (the trainer's to handle: it checkpoints); killed when the trainer dies, however it dies (Linux: a parent
    that exits at a second Ctrl-C, or is killed, leaves no orphan workers holding memory)."""
    import ctypes
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the trainer's handler, inherited by fork, is not ours)
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if "torch" in sys.modules:
        torch.set_num_threads(1)
    _WORKER_FNS[:] = [load_reward_fn(spec) for spec in specs]


def _worker_score(timeout: float, data_source, response, ground_truth, extra_info):
    import pickle

    outs = score_row(_WORKER_FNS, timeout, data_source, response, ground_truth, extra_info)
    for k, (ok, out) in enumerate(outs):  # a result that cannot travel back is that function's failure
        try:
            pickle.dumps(out)
        except Exception as e:
            outs[k] = (False, f"its result cannot be sent back from the reward worker ({type(e).__name__}: {e})")
    return outs


def _rss_gb(pid: int) -> float:
    """Resident memory of a process in GiB (Linux /proc; 0 where unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


NOT_SCORED = "not scored: an earlier row failed"


class RewardPool:
    """Custom reward functions scored in `workers` processes, as verl and OpenRLHF score off the
    training loop: rows run in parallel, a function that crashes its process (segfault, os._exit)
    or hangs in C code past the timeout costs one row, not the run. The pool is rebuilt after such
    a failure. concurrent.futures does the work; what it lacks is killing a stuck worker, done here.

    fork: the workers start in milliseconds and inherit the imported functions' modules; a reward
    function that itself starts threads before the fork is the user's to make fork-safe. With a vLLM
    engine in the process (--rollout-engine vllm) the workers are spawned instead: a child forked
    after vLLM started its OpenMP threads hangs on its first torch call."""

    def __init__(self, specs: list[str], workers: int, timeout: float, max_gb: float = 0.0):
        self.specs, self.workers, self.timeout, self.max_gb = specs, workers, timeout, max_gb
        self.pool, self.recycled = None, 0

    def _start(self):
        import multiprocessing as mp
        import sys
        from concurrent.futures import ProcessPoolExecutor

        context = mp.get_context("spawn" if "vllm" in sys.modules else "fork")
        self.pool = ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=_init_worker, initargs=(self.specs,)
        )
        _OPEN.add(self)
        # The executor forks at its first submit, in whichever thread submits: launch every worker now, in this
        # thread. PR_SET_PDEATHSIG (_init_worker) fires when the *thread* that forked a worker ends, so workers
        # forked in ScoreAsTheyFinish's per-batch thread died after each batch, and one killed while holding the
        # task queue's lock hung the run at exit. One short job per worker, all in flight at once (spawn starts a
        # worker per submit while none is idle; fork starts them all at the first).
        for job in [self.pool.submit(time.sleep, 0.05) for _ in range(self.workers)]:
            job.result()

    def start(self):
        """The workers, now, in this thread (the trainer's: see _start), unless they all run already; a pool with a
        dead worker is replaced."""
        procs = list(getattr(self.pool, "_processes", {}).values()) if self.pool is not None else []
        if self.pool is not None and not all(p.is_alive() for p in procs):
            self._kill()
        if self.pool is None:
            self._start()

    def _kill(self):
        """Stop every worker now (a stuck one never returns), then forget the pool."""
        if self.pool is None:
            return
        for proc in list(getattr(self.pool, "_processes", {}).values()):  # no public API to kill workers
            proc.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool = None

    def map(self, jobs: list[tuple], stop_at_failure: bool = False) -> list[list[tuple[bool, object]]]:
        """jobs: (data_source, response, ground_truth, extra_info) per row -> score_row's output per row.
        stop_at_failure: the first failed row ends the call (the rows after it are not scored), so a
        run without --reward-fallback stops at once instead of waiting out every queued row."""
        import time
        from concurrent.futures import TimeoutError as FutureTimeout
        from concurrent.futures.process import BrokenProcessPool

        try:
            if self.pool is None:
                self._start()
            futures = [self.pool.submit(_worker_score, self.timeout, *job) for job in jobs]
        except BrokenProcessPool:  # a worker died while idle: start afresh once
            self._kill()
            self._start()
            futures = [self.pool.submit(_worker_score, self.timeout, *job) for job in jobs]
        # each row gets its own timeout inside the worker (SIGALRM, then a watchdog); the pool-level wait only
        # catches code that never returns to Python. Rows run in submission order on `workers` processes, so row
        # i has started by the time row i - workers finished: its deadline is that time + the timeout + grace.
        t0, grace = time.monotonic(), self.timeout + 5
        finished = [None] * len(futures)
        for i, fut in enumerate(futures):
            fut.add_done_callback(lambda _, i=i: finished.__setitem__(i, time.monotonic()))
        out, broken = [], False
        for i, fut in enumerate(futures):
            try:
                started = t0 if i < self.workers else (finished[i - self.workers] or time.monotonic())
                left = None if self.timeout <= 0 else max(0.0, started + grace - time.monotonic())
                out.append(fut.result(timeout=left))
            except FutureTimeout:
                out.append(
                    [
                        (
                            False,
                            f"RewardTimeout('the reward worker gave no result within {grace:g} s "
                            f"(--reward-timeout {self.timeout:g}); it was stopped')",
                        )
                    ]
                    * len(self.specs)
                )
                broken = True
            except BrokenProcessPool as e:
                out.append([(False, f"RewardWorkerDied('the reward worker process died: {e}')")] * len(self.specs))
                broken = True
            if stop_at_failure and not all(ok for ok, _ in out[-1]):
                out += [[(False, NOT_SCORED)] * len(self.specs)] * (len(jobs) - len(out))
                broken = True  # queued and running rows are dropped with the pool
                break
        if broken:
            self._kill()
        elif self.max_gb and self.pool is not None:  # a leaking reward function: fresh workers between batches
            procs = list(getattr(self.pool, "_processes", {}).values())
            if any(_rss_gb(proc.pid) > self.max_gb for proc in procs):
                self._kill()
                self.recycled += 1
        return out

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


_OPEN = weakref.WeakSet()  # the pools started in this process


def stop_all_pools() -> None:
    """Stop every pool of this process now (a run ending on an error: common.harness.cli). Left open to the
    interpreter's exit, concurrent.futures wakes each pool from threading's shutdown, and on Python 3.11 that races
    the pool's own manager thread closing its pipe: "OSError: Bad file descriptor" printed after the run's one line
    (CI, a run whose vLLM server was killed)."""
    for pool in list(_OPEN):
        pool._kill()


# exact: 1 when the rule scorer calls the answer exactly right (its `acc`), else 0: the rule score without
# partial credit. reasoning-gym's letter_counting gives 0.25 for "1.28" when the answer is 1 (containment),
