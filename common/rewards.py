"""Rewards: verl's `compute_score` signature, a registry by `data_source`, and weighted mixes.

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict

A dict holds `score` plus extra fields that get logged (we use `acc`: exact-match accuracy, which
`eval/accuracy` reports; `score` may give partial credit). `compute_score` below is the dispatcher
(verl's `default_compute_score`); `--reward-fn file.py:fn` replaces it for every row.

`Reward` combines sources by weight, `--reward "rule:1.0,model:0.5,length:0.1"`:
    rule    the dispatcher (or --reward-fn)         per data_source
    model   a sequence-classification reward model  (--reward-model PATH; scored with its own tokenizer)
    format  1 if the response has <answer>...</answer>, else 0
    length  -(response tokens / max_new_tokens): a length penalty in [-1, 0]
    length_bonus  +(response tokens / max_new_tokens): a bounded length bonus in [0, 1]

Several custom functions, as TRL's reward_funcs + reward_weights: `--reward-fn a.py:f1 --reward-fn
b.py:f2 --reward-weights 0.6 0.4` makes `rule` their weighted sum, each logged as `reward/<f>`.
The seed's fusion 0.6 RM + 0.3 length bonus + 0.1 keyword penalty is one command:
`--reward-model RM --reward "model:0.6,length_bonus:0.3,rule:0.1" --reward-fn keyword_penalty.py:score`.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch

from common.errors import UserError, load_from_file

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_tag_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> in `text`, stripped; None when absent."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str, ground_truth) -> str | None:
    """The answer a response gives: the <answer> tag content when present; otherwise, for a
    numeric ground truth, the last number in the text (small models rarely keep the tag format:
    SmolLM2-135M never did on chain_sum, so a tags-only reward would be all zeros); else None.
    The `format` reward term rewards the tags themselves."""
    tagged = extract_tag_answer(text)
    if tagged is not None:
        return tagged
    if ground_truth is not None and NUMBER_RE.fullmatch(str(ground_truth).strip()):
        nums = NUMBER_RE.findall(text)
        return nums[-1] if nums else None
    return None


# ---------------------------------------------------------------------------------------------
# Scorers
# ---------------------------------------------------------------------------------------------
def reasoning_gym_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> dict:
    """reasoning-gym's own scorer on the answer (`extract_answer`). `extra_info["entry"]` holds the
    task's entry (question, answer, metadata) as JSON, written by `python -m tools.prepare_data`.
    score: the task's `score_answer` (may give partial credit: "11" for "1" scores 0.5);
    acc: 1 only when that score is 1 (exact)."""
    import reasoning_gym

    task = data_source.split("/", 1)[1]
    entry = (
        json.loads(extra_info["entry"])
        if extra_info and "entry" in extra_info
        else {"answer": str(ground_truth), "metadata": {}}
    )
    answer = extract_answer(solution_str, entry.get("answer", ground_truth))
    score = 0.0 if answer is None else float(reasoning_gym.get_score_answer_fn(task)(answer, entry))
    return {"score": score, "acc": float(score == 1.0)}


def _normalize_number(s: str) -> str:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        f = float(s)
        return str(int(f)) if f == int(f) else str(f)
    except ValueError:
        return s


def gsm8k_score(data_source: str, solution_str: str, ground_truth, extra_info=None, mode: str = "strict") -> dict:
    """GSM8K: strict takes the number after the last `#### `; flexible the last number in the text."""
    if mode == "strict":
        found = re.findall(r"#### (-?[0-9.,$]+)", solution_str)
    else:
        found = re.findall(r"-?[0-9][0-9.,]*", solution_str)
    ok = bool(found) and _normalize_number(found[-1]) == _normalize_number(str(ground_truth))
    return {"score": float(ok), "acc": float(ok)}


def math_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Math answers checked with math-verify (boxed or plain LaTeX, equivalent forms accepted)."""
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$" if "\\boxed" not in str(ground_truth) else str(ground_truth))
    tagged = extract_tag_answer(solution_str)
    pred = parse(f"${tagged}$" if tagged is not None else solution_str)
    ok = bool(gold) and bool(pred) and verify(gold, pred)
    return {"score": float(ok), "acc": float(ok)}


def format_score(solution_str: str) -> float:
    return float(extract_tag_answer(solution_str) is not None)


def match_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """Exact match of the <answer> content (or the whole stripped response) with ground_truth."""
    ans = extract_tag_answer(solution_str)
    ok = (ans if ans is not None else solution_str.strip()) == str(ground_truth).strip()
    return {"score": float(ok), "acc": float(ok)}


def environment_score(data_source, solution_str, ground_truth, extra_info=None):
    """Rows of a hub environment (--env textarena:GAME, openenv:URL; common.hub_envs): the environment scores them;
    a one-turn answer outside it scores 0."""
    return {"score": 0.0, "acc": 0.0}


# data_source -> scorer. Prefix entries end with "/" and match every data_source under them.
REGISTRY = {
    "reasoning_gym/": reasoning_gym_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "math": math_score,
    "match": match_score,
    "textarena/": environment_score,
    "openenv/": environment_score,
}


def find_scorer(data_source: str):
    if data_source in REGISTRY:
        return REGISTRY[data_source]
    for key, fn in REGISTRY.items():
        if key.endswith("/") and data_source.startswith(key):
            return fn
    return None


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """The dispatcher: the registry's scorer for `data_source` (verl's default_compute_score)."""
    fn = find_scorer(data_source)
    if fn is None:
        raise KeyError(f"no reward function for data_source {data_source!r}")
    return fn(data_source, solution_str, ground_truth, extra_info)


def check_data_sources(sources) -> None:
    """At start-up: every data_source has a scorer, or an error listing the known ones."""
    unknown = sorted({s for s in sources if find_scorer(s) is None})
    if unknown:
        raise UserError(
            f"unknown data_source {unknown}; known: {sorted(REGISTRY)} (or pass --reward-fn path/to/file.py:fn)"
        )


def load_reward_fn(spec: str):
    """`path/to/file.py:fn` -> the function (the file is imported only when asked; errors name --reward-fn)."""
    fn = load_from_file(spec, "--reward-fn", "function")
    if not callable(fn):
        raise UserError(f"--reward-fn {spec!r}: {spec.rpartition(':')[0]} has no function {spec.rpartition(':')[2]!r}")
    return fn


# ---------------------------------------------------------------------------------------------
# Combining sources
# ---------------------------------------------------------------------------------------------
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


# exact: 1 when the rule scorer calls the answer exactly right (its `acc`), else 0: the rule score without
# partial credit. reasoning-gym's letter_counting gives 0.25 for "1.28" when the answer is 1 (containment),
# a credit GRPO learned to farm while exact accuracy fell to 0 (docs/results.md).
SOURCES = ("rule", "exact", "model", "format", "length", "length_bonus", "remote", "judge")


def parse_mix(spec: str) -> dict[str, float]:
    """ "rule:1.0,model:0.5" -> {"rule": 1.0, "model": 0.5}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition(":")
        if name not in SOURCES:
            raise UserError(f"--reward {spec!r}: unknown source {name!r}; use {', '.join(SOURCES)}")
        try:
            out[name] = float(w or 1.0)
        except ValueError:
            raise UserError(f"--reward {spec!r}: weight of {name!r} is not a number") from None
    if not out:
        raise UserError("--reward is empty")
    return out


class Reward:
    """Scores a batch of responses with a weighted mix of sources; logs each component.

    `fallback`: None raises RewardError naming the data_source, row and response when a reward
    function raises or returns NaN/inf; a number replaces that sample's score and counts a warning."""

    def __init__(
        self,
        mix: str = "rule:1.0",
        reward_fn: str | list[str] | None = None,
        reward_model=None,
        reward_tok=None,
        max_new_tokens: int = 1,
        fallback: float | None = None,
        batch_size: int = 16,
        reward_weights: list[float] | None = None,
        timeout: float = 60.0,
        workers: int = 2,
        worker_max_gb: float = 0.0,
        remote=None,
        judge=None,
    ):
        self.mix = parse_mix(mix)
        specs = [reward_fn] if isinstance(reward_fn, str) else list(reward_fn or [])
        if reward_weights is not None and len(reward_weights) != len(specs):
            raise UserError(
                f"--reward-weights: {len(reward_weights)} weight(s) for {len(specs)} --reward-fn function(s)"
            )
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(specs)
        fns = [load_reward_fn(spec) for spec in specs]
        names = [fn.__name__ for fn in fns]
        names = [
            n if names.count(n) == 1 else f"{Path(spec.rpartition(':')[0]).stem}.{n}" for n, spec in zip(names, specs)
        ]
        # (name, function, weight); the dispatcher alone when no --reward-fn is given
        self.rule_fns = list(zip(names, fns, weights)) or [("rule", compute_score, 1.0)]
        self.custom = bool(specs)
        self.timeout = timeout
        # custom functions run in a process pool (--reward-workers; 0: in the trainer); ours in-process
        self.pool = RewardPool(specs, workers, timeout, worker_max_gb) if specs and workers > 0 else None
        if "model" in self.mix and reward_model is None:
            raise UserError("--reward includes 'model' but no --reward-model was given")
        self.reward_model, self.reward_tok = reward_model, reward_tok
        # services (common.remote_rewards): each term needs its service and each service its term
        for term, service, flag in (("remote", remote, "--reward-url"), ("judge", judge, "--judge-url")):
            if (term in self.mix) != (service is not None):
                raise UserError(
                    f"--reward includes '{term}' but no {flag} was given"
                    if service is None
                    else f"{flag} was given but --reward has no '{term}' term (e.g. --reward rule:1.0,{term}:0.5)"
                )
        self.remote, self.judge = remote, judge
        self.max_new_tokens, self.fallback, self.batch_size = max_new_tokens, fallback, batch_size
        self.errors = 0

    def counts(self) -> dict:
        """This process's failure counts since the start, the nonzero ones: reward/errors (rows scored by the fallback
        or failed), reward/judge_unparsed (judge replies without a readable grade, each try; retried)."""
        judge = self.judge.unparsed if self.judge is not None else 0
        return {k: v for k, v in (("reward/errors", self.errors), ("reward/judge_unparsed", judge)) if v}

    def check(self, data_sources) -> None:
        if ("rule" in self.mix or "exact" in self.mix) and not self.custom:
            check_data_sources(data_sources)

    def _rule(self, row, response: str, outs: list[tuple[bool, object]]) -> tuple[float, dict]:
        """The rule score of one response from each function's raw output (score_row): the function's
        score (or the weighted sum of several), and extra fields to log (each function's own score
        under its name when there are several)."""
        where = f"data_source {row.data_source!r}, row {row.uid}, response {response[:200]!r}"
        total, extras = 0.0, {}
        for (name, _, weight), (ok, out) in zip(self.rule_fns, outs):
            try:
                if not ok:
                    raise RuntimeError(out)
                extra = dict(out) if isinstance(out, dict) else {}
                score = float(extra.pop("score") if isinstance(out, dict) else out)
                if not math.isfinite(score):
                    raise ValueError(f"reward function returned {score}")
            except Exception as e:
                if self.fallback is None:
                    raise RewardError(
                        f"reward function {name!r} failed on {where}: {e if not ok else repr(e)}"
                    ) from None
                self.errors += 1
                score, extra = self.fallback, {}
            total += weight * score
            extras.update(
                {k: v for k, v in extra.items() if isinstance(v, (int, float, bool))}
            )  # verl allows text fields too
            if len(self.rule_fns) > 1:
                extras[name] = score
        return total, extras

    @torch.no_grad()
    def _model(self, rows, responses: list[str], is_eos, device) -> torch.Tensor:
        """Normalised reward-model scores (B,), each sequence encoded exactly as rm_llm.py trained on it:
        the prompt rendered with the reward model's *own* tokenizer and chat template, the response
        text, and EOS when the response ended with one (the head was trained to read the score there)."""
        from common.data import encode_prompt_response
        from common.models import apply_chat
        from common.rollout import position_ids_from_mask

        tok, cfg, out = self.reward_tok, self.reward_model.config, []
        prompts = [
            apply_chat(tok, r.messages) if r.messages is not None else r.text for r in rows
        ]  # text: already templated
        eos = [bool(e) for e in is_eos] if is_eos is not None else [False] * len(rows)
        for i in range(0, len(rows), self.batch_size):
            sl = slice(i, i + self.batch_size)
            ids, attn, _ = encode_prompt_response(
                tok,
                prompts[sl],
                responses[sl],
                eos[sl],
                max_length=getattr(cfg, "reward_max_length", None),
                device=device,
            )
            # right padding, and position ids given anyway: absolute-position models (GPT-2) need them
            out.append(
                self.reward_model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn))
                .logits[:, 0]
                .float()
            )
        # rm_llm.py stores the normalisation (mean 0, std 1 on a reference sample) in the config
        return torch.cat(out) * getattr(cfg, "reward_gain", 1.0) + getattr(cfg, "reward_bias", 0.0)

    @property
    def outside(self) -> bool:
        """Some of its calls run outside the trainer's thread (the --reward-fn worker pool, services): what
        ScoreAsTheyFinish overlaps with decoding."""
        return (self.pool is not None and ("rule" in self.mix or "exact" in self.mix)) or bool(
            self.remote or self.judge
        )

    def outside_parts(self, rows, responses: list[str], is_eos) -> dict:
        """The calls that run outside this thread, per row: {"raw": the pool's outputs, "remote"/"judge": (scores,
        failed)}. Safe in another thread (the in-process scorers are not: their timeouts are main-thread signals)."""
        parts = {}
        if self.pool is not None and ("rule" in self.mix or "exact" in self.mix):
            jobs = [(r.data_source, s, r.ground_truth, r.extra_info) for r, s in zip(rows, responses)]
            parts["raw"] = self.pool.map(jobs, stop_at_failure=self.fallback is None)
        for term, service in (("remote", self.remote), ("judge", self.judge)):
            if term in self.mix:  # a service: its failures after retries are the error, or --reward-fallback
                args = (rows, responses, is_eos) if term == "remote" else (rows, responses)
                parts[term] = service(*args, fallback=self.fallback)
        return parts

    def __call__(self, rows, responses: list[str], response_lens: torch.Tensor, device="cpu", is_eos=None, parts=None):
        """rows: PromptRow per response; responses: decoded texts (no special tokens); response_lens:
        (B,) token counts; is_eos: (B,) bool, the response ended with EOS (for the reward model); parts: what
        `outside_parts` returned for these rows, if already called (ScoreAsTheyFinish).
        Returns (scores (B,), components {name: (B,)}, extras {field: (B,)} e.g. acc)."""
        B = len(responses)
        comps, extras = {}, {}
        parts = parts if parts is not None else self.outside_parts(rows, responses, is_eos)
        if "rule" in self.mix or "exact" in self.mix:
            jobs = [(r.data_source, s, r.ground_truth, r.extra_info) for r, s in zip(rows, responses)]
            fns = [fn for _, fn, _ in self.rule_fns]
            raw = parts["raw"] if self.pool else [score_row(fns, self.timeout, *job) for job in jobs]
            # the row that failed is the error, not a row skipped after it (groups scored as rows finish: any order)
            failed = [i for i, outs in enumerate(raw) if any(not ok and out != NOT_SCORED for ok, out in outs)]
            if failed and self.fallback is None:
                self._rule(rows[failed[0]], responses[failed[0]], raw[failed[0]])
            vals = [self._rule(r, s, o) for r, s, o in zip(rows, responses, raw)]
            rule = torch.tensor([v[0] for v in vals], device=device)
            for k in {k for _, e in vals for k in e}:
                extras[k] = torch.tensor([float(e.get(k, 0.0)) for _, e in vals], device=device)
            if "rule" in self.mix:
                comps["rule"] = rule
            if "exact" in self.mix:  # the scorer's own exact-match field, else a full score
                comps["exact"] = extras["acc"].clone() if "acc" in extras else (rule >= 1).float()
        if "model" in self.mix:
            comps["model"] = self._model(rows, responses, is_eos, device).to(device)
        for term in ("remote", "judge"):
            if term in self.mix:
                vals, failed = parts[term]
                self.errors += failed
                comps[term] = torch.tensor(vals, device=device, dtype=torch.float)
        if "format" in self.mix:
            comps["format"] = torch.tensor([format_score(s) for s in responses], device=device)
        if "length" in self.mix:
            comps["length"] = -response_lens.float().to(device) / self.max_new_tokens
        if "length_bonus" in self.mix:
            comps["length_bonus"] = (response_lens.float().to(device) / self.max_new_tokens).clamp(max=1.0)
        scores = sum(self.mix[k] * v for k, v in comps.items())  # (B,)
        return scores.reshape(B), comps, extras


class ScoreAsTheyFinish:
    """Reward calls that run outside the trainer's thread (the --reward-fn worker pool, --reward-url,
    --judge-url) started on the responses decoding has finished while the rest of the batch still decodes:
    `generate(on_finished=this)` hands over each row as it ends (EOS or a stop string), a thread scores what has
    accumulated (one pool map or service request per group), and `parts` scores the rows cut at the token limit
    and waits. What runs in the trainer (built-in scorers, whose timeouts are main-thread signals; the reward
    model; format and length terms) runs after, on the whole batch. The scores are Reward's on the whole batch:
    each term is per row. vLLM returns a batch at once, so there is nothing to overlap (common.sampling.sample_and_score)."""

    def __init__(self, reward: Reward, rows, tok):
        import queue
        import threading

        self.reward, self.rows, self.tok = reward, rows, tok
        if reward.pool is not None:  # forked here, not from the thread while this one decodes (a fork copies
            reward.pool.start()  # locks other threads hold)
        self.todo, self.got, self.error, self.sent = queue.Queue(), [], None, set()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def __call__(self, idx: list[int], responses: torch.Tensor, stopped: torch.Tensor) -> None:
        """From the decoding loop: rows `idx` ended; responses (n, t) their tokens so far, stopped (n,) bool."""
        from common.models import stop_ids  # here, not at the top: reward workers start without transformers
        from common.rollout import response_masks

        _, is_eos, _ = response_masks(responses, stop_ids(self.tok), self.tok.pad_token_id, stopped)
        texts = self.tok.batch_decode(responses, skip_special_tokens=True)
        self.sent.update(idx)
        self.todo.put(list(zip(idx, texts, is_eos.tolist())))

    def _work(self):
        import queue

        while (item := self.todo.get()) is not None:
            while True:  # everything that ended meanwhile: one group
                try:
                    more = self.todo.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.todo.put(None)
                    break
                item += more
            if self.error is not None:
                continue
            idx, texts, eos = zip(*item)
            try:
                self.got.append((idx, self.reward.outside_parts([self.rows[i] for i in idx], list(texts), eos)))
            except BaseException as e:  # noqa: BLE001 -- raised in the trainer's thread by parts()
                self.error = e

    def parts(self, texts: list[str], is_eos) -> dict:
        """The rows not handed over yet (cut at the limit), then every row's parts in batch order."""
        rest = [(i, texts[i], bool(is_eos[i])) for i in range(len(self.rows)) if i not in self.sent]
        if rest:
            self.todo.put(rest)
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        B, out = len(self.rows), {}
        for idx, got in self.got:
            for key, value in got.items():
                if key == "raw":
                    slot = out.setdefault("raw", [None] * B)
                    for i, v in zip(idx, value):
                        slot[i] = v
                else:  # (scores, failed)
                    scores, failed = out.setdefault(key, ([None] * B, [0]))
                    for i, v in zip(idx, value[0]):
                        scores[i] = v
                    failed[0] += value[1]
        return {k: v if k == "raw" else (v[0], v[1][0]) for k, v in out.items()}


def reward_by_data_source(rows, scores) -> dict:
    """{reward/<data_source>: mean score of this rank's rows of it} when the rows mix several sources, else {}."""
    sources = sorted({x.data_source for x in rows})
    if len(sources) < 2:
        return {}
    sel = lambda src: torch.tensor([x.data_source == src for x in rows], device=scores.device)
    return {f"reward/{src}": scores[sel(src)].mean().item() for src in sources}


def reward_from_args(rewards, model, max_new_tokens: int, accelerator) -> Reward:
    """The Reward of a script's RewardArgs `rewards` (common.args): --reward / --reward-fn, --reward-model (loaded
    frozen at --dtype of ModelArgs `model`, with its own tokenizer and chat template, which may differ from the
    policy's), --reward-weights, --reward-fallback, --reward-timeout and --reward-workers; responses are scored
    up to `max_new_tokens`."""
    from common import models as M
    from common.distributed import prepare_frozen

    path, trust = rewards.reward_model, model.trust_remote_code
    if path:
        M.check_reward_model(path, "--reward-model", trust)  # a causal LM would score with a random head
    rm_tok = M.load_reward_tokenizer(path, trust) if path else None  # with the prompt format it was trained on
    reward_model = prepare_frozen(accelerator, M.load_reward_model(path, rm_tok, model.dtype)) if path else None
    return Reward(
        rewards.reward,
        rewards.reward_fn,
        reward_model,
        rm_tok,
        max_new_tokens,
        rewards.reward_fallback,
        reward_weights=rewards.reward_weights,
        timeout=rewards.reward_timeout,
        workers=rewards.reward_workers,
        worker_max_gb=rewards.reward_worker_max_gb,
        **services_from_args(rewards),
    )


def services_from_args(rewards) -> dict:
    """The reward services of RewardArgs `rewards`: {remote: RemoteScorer | None, judge: JudgeScorer | None}."""
    from common.remote_rewards import DEFAULT_JUDGE_TEMPLATE, JudgeScorer, RemoteScorer, ServiceConfig

    cfg = lambda url: ServiceConfig(
        url, timeout=rewards.service_timeout, retries=rewards.service_retries, concurrency=rewards.service_concurrency
    )
    judge = None
    if rewards.judge_url:
        if not rewards.judge_model:
            raise UserError("--judge-url needs --judge-model (the model name the endpoint serves)")
        template = Path(rewards.judge_template).read_text() if rewards.judge_template else DEFAULT_JUDGE_TEMPLATE
        judge = JudgeScorer(cfg(rewards.judge_url), rewards.judge_model, template)
    return dict(remote=RemoteScorer(cfg(rewards.reward_url)) if rewards.reward_url else None, judge=judge)
