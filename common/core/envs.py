"""Environments: multi-turn rollouts where the policy talks to an environment (tools, feedback) over several turns.

The interface (docs/agents.md): one `Environment` instance per trajectory (it may keep state), made by the harness
with the row's scorer; `reset(row)` returns the first messages; `step(text, ids)` gets the model's turn (its text and
its sampled token ids) and returns a `Step` (observation messages for the next turn or None, reward, done, info).
`close()` frees what it holds. Users plug theirs with `--env path/to/file.py:ClassName`.

Token in, token out (`Episodes.run`): the sampler's ids of every model turn are kept as sampled; an observation is
the chat template's own rendering of its messages as the text that follows the model's turn (computed once per
observation), tokenized alone and appended. Past turns are never re-rendered or re-tokenized, so the trainer
scores exactly the ids the sampler produced and saw, whatever the template does to earlier turns (drop <think>
blocks, reformat tool calls). The loss mask is 1 on the model's tokens only: observations get no policy gradient,
KL, entropy or value loss.

Legend: B trajectories, P (left-padded) prompt length, T the longest trajectory after its prompt.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

from common.core.chat import apply_chat, resolve_tool_format, stop_ids
from common.core.data import observation_ids, turn_glue
from common.core.errors import UserError
from common.core.generation import Generation, generate
from common.core.reward_workers import call_with_timeout
from common.core.seeds import mix_seed


@dataclass
class Step:
    observation: list[dict] | None = None  # messages for the next turn ({role, content}); None: nothing to add
    reward: float = 0.0  # this step's reward; a trajectory's score is the sum over its steps
    done: bool = False  # the trajectory ends after this step
    info: dict = field(default_factory=dict)  # numbers summed per trajectory, logged as env/<key> (see info_keys)


class Environment:
    """One trajectory's environment. The harness sets, before `reset`: `score(text) -> float`, the run's reward
    (--reward on this row: rule, model or mix) for `text` as the answer; `max_turns`; `template_tools` (the chat
    template renders `tools=` itself) and `tool_format` (how a call is written: resolve_tool_format); before each
    `step`: `turn` (1-based) and `final` (this turn is the trajectory's last: out of turns, or cut by a token budget;
    give the final reward now)."""

    tools: list[dict] = []  # JSON schemas passed to the chat template as tools= (when it supports them)
    info_keys: tuple[str, ...] = ()  # the Step.info keys logged (every process logs the same keys: declared here)
    score = staticmethod(lambda text: 0.0)
    max_turns, turn, final, template_tools, tool_format = 1, 0, False, False, "text"

    def reset(self, row) -> list[dict] | str:
        """The first messages of the conversation (a PromptRow's `messages`: the dataset prompt)."""
        return row.messages if row.messages is not None else row.text

    def step(self, text: str, ids: list[int]) -> Step:
        """The model's turn -> what follows. Default: score the answer, one turn."""
        return Step(None, self.score(text), True)

    def close(self) -> None:
        pass


def tool_metrics(metrics: dict) -> dict:
    """The rates of tool learning from a step's batch means of ToolEnv's per-trajectory counts (`env/<key>`):
    env/tool_call_rate (share of trajectories with a call), env/tool_success_rate (share of calls that ran without
    an error), env/answer_after_tool (share of final answers given after a tool result). A ratio of two batch means
    over the same trajectories is the ratio of the sums. {} without the tool environment's keys."""
    m = metrics
    if "env/tool_calls" not in m or "env/tool_used" not in m:
        return {}
    out = {"env/tool_call_rate": m["env/tool_used"]}
    if m["env/tool_calls"] > 0:
        out["env/tool_success_rate"] = 1 - m["env/tool_errors"] / m["env/tool_calls"]
    if m.get("env/answered", 0) > 0:
        out["env/answer_after_tool"] = m["env/answer_after_tool"] / m["env/answered"]
    return out


@dataclass
class EpisodeRollout(Generation):
    queries: torch.Tensor | None = None  # (B, P) left-padded: the first messages, rendered
    query_mask: torch.Tensor | None = None  # (B, P)
    scores: torch.Tensor | None = None  # (B,) the environment's reward of each trajectory (sum over its steps)
    turn_rewards: torch.Tensor | None = None  # (B, T) each step's reward at the last model token of its turn
    stats: dict = field(default_factory=dict)  # env/<name>: (B,) per-trajectory counts, logged as means
    transcripts: list[str] = field(default_factory=list)  # who said what, for samples.jsonl
    turn_ids: list[list[tuple[list[int], list[int]]]] = field(default_factory=list)  # per trajectory, per model
    # turn: (the context ids the sampler was given, the ids it returned): what tests compare with query_responses
    messages: list[list[dict]] = field(default_factory=list)  # per trajectory: the conversation as messages (the
    # first ones, each model turn's text, each observation): an SFT row (common.core.data.encode_conversation)


def messages_problem(x, what: str) -> str | None:
    """None if `x` is what reset() (a str, or a non-empty list of {role, content} dicts of strings) or a Step's
    observation (a list of such dicts; empty or None: nothing to add) may be; else what is wrong, in words."""
    if what == "reset" and isinstance(x, str) and x.strip():
        return None
    if what == "observation" and (x is None or (isinstance(x, list) and not x)):
        return None
    if not isinstance(x, list) or not x:
        return f"returned {type(x).__name__} {str(x)[:60]!r}, not a list of {{role, content}} messages"
    for m in x:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"returned a message {str(m)[:60]!r}: each must be a dict with string 'role' and 'content'"
    return None


def step_problem(step) -> str | None:
    """None if `step` is a usable Step (a finite number as its reward, a dict of numbers as its info, messages as
    its observation); else what is wrong (a gym-style tuple, a tensor or string reward, ...)."""
    if not isinstance(step, Step):
        return f"returned {type(step).__name__} {str(step)[:60]!r}, not a Step(observation, reward, done, info)"
    try:
        reward = float(step.reward)
    except (TypeError, ValueError, RuntimeError):
        return f"returned the reward {str(step.reward)[:60]!r}, not a number"
    if isinstance(step.reward, (str, bytes)) or not math.isfinite(reward):
        return f"returned the reward {str(step.reward)[:60]!r}, not a finite number"
    if not isinstance(step.info, dict):
        return f"returned info {str(step.info)[:60]!r}, not a dict"
    for k, v in step.info.items():
        try:
            ok = not isinstance(v, (str, bytes)) and math.isfinite(float(v))
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if not ok:
            return f"returned info[{k!r}] = {str(v)[:40]!r}, not a finite number"
    return messages_problem(step.observation, "observation")


# ----------------------------------------------------------------------------------- environments in worker processes
class EnvWorkerError(Exception):
    """An environment in a worker process gave no answer in time (its process killed), died, or raised."""


def _env_worker_main(conn, factory) -> None:
    """A worker process (`EnvWorker`): one environment at a time, made by ("make", attrs); each ("call", method, args,
    attrs) sets the harness's attributes on it (turn, final, ...) and answers ("ok", result, {its `tools` and those
    attributes as it left them}) or ("err", what). The environment's `score(text)` asks the trainer ("score", text),
    which answers ("score", value)."""
    import ctypes
    import signal
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the trainer, however it ends
    torch.set_num_threads(1)
    env, me = None, os.getpid()

    def ask_score(text):
        conn.send(("score", text))
        kind, value = conn.recv()
        if kind != "score" or isinstance(value, str):
            raise RuntimeError(f"the run's reward failed: {value}")
        return value

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the trainer closed the pipe
            os._exit(0)
        try:
            _, method, args, attrs = msg
            if method == "make":
                env = factory()
                env.score = ask_score
            for k, v in attrs.items():
                setattr(env, k, v)
            out = None if method == "make" else getattr(env, method)(*args)
            if os.getpid() != me:  # the environment forked, and this is the copy: it must not answer or read on
                os._exit(0)
            # what the harness reads back: its tools, and the attributes it set, as the environment left them
            state = {k: getattr(env, k) for k in ("tools", *attrs, "final") if hasattr(env, k)}
            conn.send(("ok", out, state))
        except BaseException as e:  # noqa: BLE001 -- the environment's failure (a bug, an unpicklable answer, exit)
            if os.getpid() != me:
                os._exit(0)
            conn.send(("err", f"{type(e).__name__}: {e}"[:500]))


class EnvWorker:
    """A forked process that hosts the environment of one trajectory at a time (--env-workers: the default of the
    scripts' --env runs). Every call is bounded by `timeout` seconds, however the environment behaves: one that
    ignores SIGALRM and the real-time signals, catches the timeout exception and sleeps on, calls os._exit or
    forks cannot hang or end the run, or write into it: the process is killed (SIGKILL) and replaced at the next
    trajectory, and the call is a counted failure. The run's reward (`score`) stays in the trainer."""

    def __init__(self, factory):
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # the factory (a user class loaded from its file) is inherited, not pickled
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_env_worker_main, args=(child, factory), daemon=True)
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def call(self, method: str, args: tuple, attrs: dict, score, timeout: float):
        """(result, {the environment's `tools`, `attrs` as it left them}) of env.<method>(*args) in the worker;
        score(text): the trainer's answer to the environment's score requests. EnvWorkerError past `timeout`
        seconds in all (the process is then killed), at its death, or when the environment raised."""
        deadline = time.time() + timeout
        try:
            self.conn.send(("call", method, args, attrs))
            while True:
                left = deadline - time.time()
                if left <= 0:
                    self.kill()
                    raise EnvWorkerError(f"no answer in {timeout:g} s (--env-timeout; its process killed)")
                if not self.conn.poll(min(left, 0.5)):
                    if not self.proc.is_alive():
                        raise EnvWorkerError(f"its process ended (exit code {self.proc.exitcode})")
                    continue
                msg = self.conn.recv()
                if msg[0] == "score":
                    try:
                        value = float(score(msg[1]))
                    except Exception as e:  # noqa: BLE001 -- sent back: the environment's score() raises it
                        value = f"{type(e).__name__}: {e}"
                    self.conn.send(("score", value))
                    continue
                if msg[0] == "err":
                    raise EnvWorkerError(msg[1])
                return msg[1], msg[2]
        except (EOFError, OSError, BrokenPipeError):
            self.kill()
            raise EnvWorkerError(f"its process ended (exit code {self.proc.exitcode})") from None


class _InWorker:
    """The harness's view of an environment in an `EnvWorker`: reset / step / close forwarded; the attributes the
    harness sets (turn, final, max_turns, template_tools, tool_format) go along with the next call; `score` stays
    here."""

    def __init__(self, worker: EnvWorker, timeout: float):
        self.__dict__.update(_worker=worker, _timeout=timeout, _attrs={}, tools=None, score=None)

    def __getattr__(self, key):  # what the harness set (turn, final, ...)
        try:
            return self.__dict__["_attrs"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        if key in ("tools", "score"):
            self.__dict__[key] = value
        else:
            self._attrs[key] = value

    def _call(self, method, *args):
        if method == "close" and not self._worker.alive():  # killed at an earlier call: that was the failure
            return None
        out, state = self._worker.call(method, args, self._attrs, self.score, self._timeout)
        self.__dict__["tools"] = state.pop("tools", None)
        self._attrs.update(state)  # e.g. `final` changed by the environment in its step, as in process
        return out

    def make(self):
        return self._call("make") or self

    def reset(self, row):
        return self._call("reset", row)

    def step(self, text, ids):
        return self._call("step", text, ids)

    def close(self):
        return self._call("close")


class Episodes:
    """Runs a batch of trajectories with one environment instance each (module docstring).

    env_factory() -> Environment (its class, or functools.partial of it); score(row, text) -> float (the run's reward);
    budgets: `max_turns` model turns, each at most --max-new-tokens, and `max_tokens` after the prompt in all (model and
    observation tokens); a trajectory that runs out is marked truncated. Environment calls (make, reset, step, close)
    run under `timeout` seconds (common.core.reward_workers.call_with_timeout); one that raises or hangs ends its
    trajectory with reward 0 and counts in env/errors (the first message is printed once): never a crash or a hang of
    the run."""

    def __init__(self, env_factory, tok, score, max_turns: int, max_tokens: int, timeout: float, log=print,
                 max_prompt_tokens: int | None = None, workers: bool = False, tool_format: str = "auto"):  # fmt: skip
        self.factory, self.tok, self.score, self.max_prompt_tokens = env_factory, tok, score, max_prompt_tokens
        # workers: each trajectory's environment in a worker process (EnvWorker), kept across batches
        self.workers, self._pool = workers, []
        self.max_turns, self.max_tokens, self.timeout, self.log = max_turns, max_tokens, timeout, log
        # how tool calls are written (tool_format); an environment that parses the calls (ToolEnv's
        # `parses_tool_calls`) needs a known format
        self.tool_format = resolve_tool_format(tok, tool_format)
        cls = getattr(env_factory, "func", env_factory)
        if self.tool_format == "unknown" and getattr(cls, "parses_tool_calls", False):
            raise UserError(f"--env tools: the chat template of {tok.name_or_path} renders tools= in a format the tool "
                            'parser does not know (known: Hermes/Qwen <tool_call>{"name", "arguments"}</tool_call>, '
                            'Llama 3.x JSON {"name", "parameters"}); --tool-format text lists the tools in the system '
                            "message instead")  # fmt: skip
        self.template_tools = self.tool_format not in ("text", "code")  # else our protocol, in the system message
        # a turn that ends at one of these (the environment's `stop_strings(tool_format)`: a call's closing tag) gets
        # the template's turn end appended, as the model's token (mask 1, sampler log-prob 0), as if it had stopped
        self.stop_strings = list(getattr(cls, "stop_strings", lambda fmt: [])(self.tool_format))
        # the environment class's declared Step.info keys (a class, or functools.partial of one)
        self.info_keys = tuple(getattr(getattr(env_factory, "func", env_factory), "info_keys", ()))
        self.errors, self._glue, self._said = 0, None, False
        # hf engine: each trajectory's KV cache kept across turns, so a turn prefills only the new ids (the previous
        # turn's EOS and the observation), not the prompt and every earlier turn again (False: full prefill each turn)
        self.kv_cache = True

    def _make(self, i: int):
        """Trajectory i's environment: made here, or (workers) in worker i (started, or replaced if it was killed)."""
        if not self.workers:
            return self.factory()
        while len(self._pool) <= i:
            self._pool.append(None)
        if self._pool[i] is None or not self._pool[i].alive():
            self._pool[i] = EnvWorker(self.factory)
        return _InWorker(self._pool[i], self.timeout).make()

    def close(self) -> None:
        """Stop the worker processes (they also end with the trainer)."""
        for w in self._pool:
            if w is not None:
                w.kill()
        self._pool = []

    def _call(self, what: str, fn, *a):
        """(ok, fn(*a)) under the timeout (in a worker: its own, enforced by killing it); a failure is counted, the
        first one printed. In process, a call that changed the working directory (the run's relative paths) is put
        back and counted as failed, and a fork's copy never returns into the trainer (it would run a second one)."""
        cwd, pid = os.getcwd(), os.getpid()
        try:
            out = fn(*a) if self.workers else call_with_timeout(fn, self.timeout, *a)
        except BaseException as e:  # user code: SystemExit / KeyboardInterrupt inside it are its failure too
            if os.getpid() != pid:
                os._exit(0)
            return self._fail(what, f"{type(e).__name__}: {e}"), None
        finally:
            if os.getpid() != pid:  # the environment forked, and this is the copy
                os._exit(0)
            moved = os.getcwd() != cwd
            if moved:
                os.chdir(cwd)
        return (self._fail(what, f"changed the working directory (put back to {cwd})"), None) if moved else (True, out)

    def _fail(self, what: str, problem: str) -> bool:
        """Count a failed environment call (env/errors), print the first; False."""
        self.errors += 1
        if not self._said:
            self._said = True
            self.log(f"warning: environment {what} failed: {problem} (counted in env/errors)")
        return False

    def glue(self) -> str:
        """What the template writes after an assistant turn's EOS token (e.g. '\\n' after <|im_end|>): rendered once."""
        if self._glue is None:
            self._glue = turn_glue(self.tok)
        return self._glue

    def observation_ids(self, messages: list[dict]) -> list[int]:
        """The tokens that follow a model turn when `messages` come next (common.core.data.observation_ids: the one
        rule, shared with multi-turn SFT's `encode_conversation`)."""
        return observation_ids(self.tok, messages, self.glue())

    def _left_pad(self, seqs: list[list[int]], device):
        P = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), P), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), P, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, P - len(s) :], mask[i, P - len(s) :] = torch.tensor(s, dtype=torch.long), 1
        return ids.to(device), mask.to(device)

    @torch.no_grad()
    def run(self, model, rows, seeds, engine=None, max_new_tokens=48, temperature=1.0, top_k=0, top_p=1.0, prefix=""):
        """Trajectories for `rows` (one each; `seeds` per row, None: greedy) -> EpisodeRollout. The first turn of
        row i samples with seeds[i] (as a one-turn rollout does), turn k with mix_seed(seeds[i], k).

        prefix: text forced at the start of the first model turn (tools.gen_demos: e.g. `<tool_call>`, so a model
        that never starts a call writes the rest of one); its tokens are part of the turn (mask 1, sampler
        log-prob 0) and of its text: demonstrations, not on-policy samples."""
        tok, B = self.tok, len(rows)
        forced = tok(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        device = next(model.parameters()).device
        envs, prompts, convs, messages = [], [], [], []  # messages: each conversation, for SFT rows
        for i, row in enumerate(rows):
            ok, env = self._call("construction", self._make, i)
            if ok:
                env.score = lambda text, row=row: self.score(row, text)
                env.max_turns, env.turn, env.template_tools = self.max_turns, 0, self.template_tools
                env.tool_format = self.tool_format
                ok, msgs = self._call("reset", env.reset, row)
                problem = messages_problem(msgs, "reset") if ok else None
                ok = ok and (problem is None or self._fail("reset", problem))
            for _ in range(2):  # the environment's first messages; on a failure (or too long) the row's prompt
                msgs = msgs if ok else (row.messages if row.messages is not None else row.text)
                tools = getattr(env, "tools", None) if ok and self.template_tools else None
                text = apply_chat(tok, msgs, tools=tools) if not isinstance(msgs, str) or tok.chat_template else msgs
                prompt = tok(text, add_special_tokens=False)["input_ids"]
                if not ok or self.max_prompt_tokens is None or len(prompt) <= self.max_prompt_tokens:
                    break  # (a first message beyond the context would be sampled on for minutes, then cut)
                ok = self._fail("reset", f"returned a first message of {len(prompt)} tokens, more than "
                                f"--max-prompt-length {self.max_prompt_tokens}")  # fmt: skip
            envs.append(env if ok else None)
            prompts.append(prompt)
            messages.append(list(msgs) if isinstance(msgs, list) else [{"role": "user", "content": msgs}])
            convs.append([f"{m['role']}: {m['content']}" for m in messages[-1]])
        ids, own, lps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]  # own: 1 = model's
        done, truncated, is_eos = [e is None for e in envs], [False] * B, [False] * B
        score, paid = [0.0] * B, [[] for _ in range(B)]  # paid: (position of the turn's last model token, reward)
        stats = {k: [0.0] * B for k in ("turns", "errors", *self.info_keys)}  # the same keys on every process
        turn_ids = [[] for _ in range(B)]
        caches = {}  # trajectory -> its RowCache after its last turn (hf engine, self.kv_cache)
        for i in range(B):
            stats["errors"][i] = float(envs[i] is None)
        for turn in range(1, self.max_turns + 1):
            active = [i for i in range(B) if not done[i]]
            if not active:
                break
            force = forced if turn == 1 else []  # --prefix: the first turn starts with these tokens
            # sampled tokens this turn (>= 1 without --prefix: below); forced ones count against the trajectory only
            budget = {i: min(max_new_tokens, self.max_tokens - len(ids[i]) - len(force)) for i in active}
            ctx = [prompts[i] + ids[i] + force for i in active]
            queries, qmask = self._left_pad(ctx, device)  # (b, P + ids so far)
            turn_seeds = (
                None if seeds is None else [seeds[i] if turn == 1 else mix_seed(seeds[i], turn) for i in active]
            )
            keep = self.kv_cache and engine is None
            past = [caches.get(i) for i in active] if keep and turn > 1 else None
            past = past if past is not None and all(c is not None for c in past) else None
            out = generate(model, tok, queries, qmask, max(1, max(budget.values())), temperature, top_k, top_p,
                           turn_seeds, engine=engine, past=past, keep_row_caches=keep,
                           stop_strings=self.stop_strings or None)  # fmt: skip
            caches = {i: out.row_caches[k] for k, i in enumerate(active)} if out.row_caches is not None else {}
            for k, i in enumerate(active):
                n = max(0, min(int(out.response_mask[k].sum()), budget[i]))
                new = out.responses[k, :n].tolist()
                whole = n == int(out.response_mask[k].sum())  # not cut by this trajectory's token budget
                stopped = whole and not bool(out.is_eos[k]) and not bool(out.truncated[k])  # at a stop string
                lps[i] += [0.0] * len(force) + (out.logprobs[k, :n].tolist() if out.logprobs is not None else [0.0] * n)
                text = tok.decode(force + new, skip_special_tokens=True)
                if stopped:  # the turn's end after the call's closing tag: the ids the template renders
                    new, lps[i] = new + stop_ids(tok)[:1], lps[i] + [0.0]
                turn_ids[i].append((ctx[k], new))
                ids[i] += force + new
                own[i] += [1] * (len(force) + len(new))
                ended = whole and (bool(out.is_eos[k]) or stopped)
                is_eos[i], stats["turns"][i] = ended, stats["turns"][i] + 1
                convs[i].append(f"assistant: {text}")
                messages[i].append({"role": "assistant", "content": text})
                envs[i].turn, envs[i].final = (
                    turn,
                    not ended or turn == self.max_turns or len(ids[i]) >= self.max_tokens,
                )
                ok, step = self._call("step", envs[i].step, text, new)
                problem = step_problem(step) if ok else None
                if not ok or (problem is not None and not self._fail("step", problem)):
                    stats["errors"][i] = 1.0
                    done[i], score[i], paid[i] = True, 0.0, []
                    continue
                score[i] += float(step.reward)
                if any(own[i]):  # else (no model token yet) Rollout.token_scores puts it on the last one
                    paid[i].append((len(own[i]) - 1 - own[i][::-1].index(1), float(step.reward)))
                for key, v in step.info.items():
                    if key in stats:
                        stats[key][i] += float(v)
                truncated[i] = not ended  # this turn was cut by a token budget
                if step.done or envs[i].final:
                    done[i], truncated[i] = True, truncated[i] or not step.done  # out of turns before it was done
                elif step.observation:
                    obs = self.observation_ids(step.observation)
                    if len(ids[i]) + len(obs) >= self.max_tokens:  # no room for the observation and an answer
                        done[i] = truncated[i] = True
                    else:
                        ids[i] += obs
                        own[i] += [0] * len(obs)
                        lps[i] += [0.0] * len(obs)
                        convs[i] += [f"{m['role']}: {m['content']}" for m in step.observation]
                        messages[i] += [dict(m) for m in step.observation]
        for env in envs:
            if env is not None:
                self._call("close", env.close)
        T = max(1, max(len(x) for x in ids))
        queries, query_mask = self._left_pad(prompts, device)  # (B, P)
        responses = torch.full((B, T), tok.pad_token_id, dtype=torch.long)
        mask, logprobs, turn_rewards = torch.zeros(B, T), torch.zeros(B, T), torch.zeros(B, T)
        for i in range(B):
            n = len(ids[i])
            responses[i, :n] = torch.tensor(ids[i], dtype=torch.long)
            mask[i, :n], logprobs[i, :n] = torch.tensor(own[i], dtype=torch.float), torch.tensor(lps[i])
            for t, r in paid[i]:
                turn_rewards[i, t] += r
        n_tokens = torch.tensor([float(len(x)) for x in ids])
        stats["obs_frac"] = (1 - mask.sum(1) / n_tokens.clamp(min=1)).tolist()
        responses, mask = responses.to(device), mask.to(device)
        return EpisodeRollout(
            torch.cat([queries, responses], 1),
            responses,
            mask,
            torch.tensor(is_eos, device=device),
            torch.tensor(truncated, device=device),
            logprobs.to(device) if seeds is not None else None,
            queries=queries,
            query_mask=query_mask,
            scores=torch.tensor(score, device=device),
            turn_rewards=turn_rewards.to(device),
            # counts as env/<key>; seconds (a key ending in _s) as perf/<key>: timings, not what was learned
            stats={
                f"{'perf' if k.endswith('_s') else 'env'}/{k}": torch.tensor(v, device=device) for k, v in stats.items()
            },
            transcripts=["\n".join(c) for c in convs],
            turn_ids=turn_ids,
            messages=messages,
        )


@torch.no_grad()
def evaluate_with_env(episodes: Episodes, model, rows, max_new_tokens: int, batch_size: int, engine=None):
    """Greedy trajectories for `rows` (tools.evaluate --env): (results as common.harness.eval.score gives them, overall
    and per data_source: reward (the environment's), accuracy (reward >= 1), n, turns, tool_calls per trajectory,
    tool_call_rate (share of trajectories with a call); the transcripts)."""
    per, transcripts = {}, []
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        ro = episodes.run(model, batch, None, engine, max_new_tokens)
        transcripts += ro.transcripts
        calls = ro.stats.get("env/tool_calls", torch.zeros(len(batch))).tolist()
        used = ro.stats.get("env/tool_used", torch.zeros(len(batch))).tolist()
        # the environment's own counts (TextArena's win, invalid_move, ...: its info_keys), per trajectory
        own = {k: ro.stats[f"env/{k}"].tolist() for k in episodes.info_keys
               if f"env/{k}" in ro.stats and k not in ("tool_calls", "tool_used")}  # fmt: skip
        for j, (row, s, turns, c, u) in enumerate(
            zip(batch, ro.scores.tolist(), ro.stats["env/turns"].tolist(), calls, used)
        ):
            for key in ("all", row.data_source):
                d = per.setdefault(key, {"reward": [], "accuracy": [], "turns": [], "tool_calls": [],
                                         "tool_call_rate": [], **{k: [] for k in own}})  # fmt: skip
                for m, v in zip(d, (s, float(s >= 1), turns, c, u, *(own[k][j] for k in own))):
                    d[m].append(v)
    return {
        k: {m: sum(v) / len(v) for m, v in d.items()} | {"n": len(d["reward"])} for k, d in per.items()
    }, transcripts
