"""Environments (common/core/envs.py, common/integrations/sandbox.py): the Python tool's guarantees, tool-call parsing,
token in / token out over several turns (the trainer scores exactly the sampled ids), observation tokens out of every
loss, and failures of user environments bounded."""

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from common.core import chat
from common.core import models as M
from common.core.envs import Environment, Episodes, Step
from common.integrations.builtin_envs import FeedbackEnv
from shared_envs import REPO, TOY_REWARD, Returns, ScriptedEngine, _env_flags, _resumes_exactly, _rows, _score

sys.path.insert(0, str(REPO / "algos"))


class IgnoresSignals(Environment):
    """Ignores SIGALRM and the watchdog's real-time signal, then sleeps: no in-process bound stops it."""

    def step(self, text, ids):
        import signal

        for sig in (signal.SIGALRM, signal.SIGRTMIN + 3):
            signal.signal(sig, signal.SIG_IGN)
        time.sleep(3600)


class CatchesTheTimeout(Environment):
    def step(self, text, ids):
        while True:
            try:
                time.sleep(3600)
            except BaseException:  # noqa: BLE001 -- the hostile case: keeps sleeping
                pass


class ExitsHard(Environment):
    def step(self, text, ids):
        os._exit(3)


class Forks(Environment):
    """Forks in step: both copies return (the catalogue: two trainers wrote one run folder)."""

    def step(self, text, ids):
        os.fork()
        return Step(None, 1.0, True)


@pytest.mark.e2e  # (a few seconds: the fast tier stays under 5 minutes)
@pytest.mark.parametrize("cls", [IgnoresSignals, CatchesTheTimeout, ExitsHard], ids=lambda c: c.__name__)
def test_in_worker_processes_no_environment_can_hang_or_end_the_run(tiny, cls):
    """What in-process bounds cannot hold against (docs/agents.md): an environment that ignores the timeout's
    signals, catches its exception and sleeps on, or calls os._exit. In a worker each is a counted failure within
    --env-timeout (the worker killed, and replaced for the next batch, which runs as usual)."""
    tok = chat.load_tokenizer(tiny)
    model, logs = M.load_causal_lm(tiny, tok), []
    eps = Episodes(cls, tok, _score, max_turns=2, max_tokens=50, timeout=1.0, log=logs.append, workers=True)
    t0 = time.time()
    ro = eps.run(model, _rows(2), seeds=[0, 1], engine=ScriptedEngine(tok, lambda ctx: "42"))
    assert time.time() - t0 < 8 and ro.stats["env/errors"].tolist() == [1, 1] and ro.scores.tolist() == [0, 0]
    want = "exit code 3" if cls is ExitsHard else "no answer in 1 s"
    assert len(logs) == 1 and want in logs[0], logs
    pids = [w.proc.pid for w in eps._pool]
    eps.factory = partial(FeedbackEnv, turn_cost=0.0)  # the next batch: new workers, and they work
    ro = eps.run(model, _rows(2), seeds=[0, 1], engine=ScriptedEngine(tok, lambda ctx: "42"))
    assert ro.scores.tolist() == [1.0, 1.0] and [w.proc.pid for w in eps._pool] != pids
    eps.close()


@pytest.mark.e2e  # (a few seconds: the fast tier stays under 5 minutes)
@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "workers"])
def test_an_environment_that_forks_leaves_one_trainer(tiny, tmp_path, workers):
    """In process (--no-env-workers), a fork's copy returning into the harness would run a second trainer; in a
    worker, a second reader of the worker's pipe that outlives the run (and holds its output open). The copy ends
    where it returns (os._exit): after the batch only this process writes, and no copy runs on."""
    tok = chat.load_tokenizer(tiny)
    eps = Episodes(Forks, tok, _score, max_turns=2, max_tokens=50, timeout=5, workers=workers)
    me = os.getpid()
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(2), seeds=[0, 1], engine=ScriptedEngine(tok, lambda ctx: "42"))
    with open(tmp_path / "writers", "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    assert os.getpid() == me and (tmp_path / "writers").read_text().split() == [str(me)]
    assert ro.scores.tolist() == [1.0, 1.0]
    workers_ = {w.proc.pid for w in eps._pool}  # their forks' copies: exited (zombies at most), none running
    running = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) in workers_ and fields[0] not in ("Z", "X"):
            running.append(stat.parent.name)
    eps.close()
    assert len(workers_) == (2 if workers else 0) and not running, running


@pytest.mark.e2e  # (a few seconds: the fast tier stays under 5 minutes)
def test_a_first_message_beyond_the_prompt_budget_is_a_counted_failure(tiny):
    """reset() returning 200,000 words (the catalogue: never checked, minutes of sampling on it): a counted failure
    (env/errors, one line) within seconds, the trajectory on the row's own prompt with no turns; a first message
    within --max-prompt-length runs as usual."""
    tok = chat.load_tokenizer(tiny)
    logs, engine = [], ScriptedEngine(tok, lambda ctx: "42")
    huge = [{"role": "user", "content": "word " * 200_000}]
    eps = Episodes(partial(Returns, "reset", huge), tok, _score, max_turns=2, max_tokens=50, timeout=30,
                   log=logs.append, max_prompt_tokens=256)  # fmt: skip
    t0 = time.time()
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(2), seeds=[0, 1], engine=engine)
    assert time.time() - t0 < 30 and ro.stats["env/errors"].tolist() == [1, 1] and ro.scores.tolist() == [0, 0]
    assert ro.queries.shape[1] < 256 and ro.stats["env/turns"].tolist() == [0, 0]
    assert len(logs) == 1 and "first message of 200" in logs[0] and "--max-prompt-length 256" in logs[0], logs
    short = [{"role": "user", "content": "word " * 20}]
    eps = Episodes(partial(Returns, "reset", short), tok, _score, max_turns=1, max_tokens=50, timeout=30,
                   max_prompt_tokens=256)  # fmt: skip
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=engine)
    assert ro.stats["env/errors"].tolist() == [0] and ro.stats["env/turns"].tolist() == [1]


@pytest.mark.e2e
def test_grpo_with_tools_runs_multi_turn_and_resumes_exactly(tiny_agent, toy_prompts, tmp_path):
    flags = lambda out: _env_flags(tiny_agent, toy_prompts, out, "--env", "tools", "--tools", "calculator",
                                   "--num-prompts", 4, "--group-size", 2, "--mini-batch-size", 8, "--kl-coef", 0.05, lr=1e-4)  # fmt: skip
    rows, run = _resumes_exactly("grpo_llm.py", flags, tmp_path, {"TOY_MODEL": tiny_agent})
    # (the agent calls the calculator in half its turns before any update; a low learning rate keeps it calling it
    # in the resumed steps, which is what the resume must reproduce; sampled from 8 trajectories, so any of them)
    calls = lambda r: r["env/turns"] > 1 and r["env/tool_calls"] > 0 and 0 < r["env/obs_frac"] < 1
    assert calls(rows[0]) and any(calls(r) for r in rows[1:]), rows
    assert all(r["env/errors"] == 0 for r in rows) and rows[-1]["train/kl"] > 0
    assert rows[-1]["train/sampler_logprob_diff"] < 1e-4  # the trainer scores the sampled ids (token in, token out)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert any("<tool_response>2</tool_response>" in s["response"] and "assistant: " in s["response"] for s in samples)


@pytest.mark.e2e
def test_ppo_with_feedback_runs_multi_turn_and_resumes_exactly(tiny_agent, toy_prompts, tmp_path):
    flags = lambda out: _env_flags(tiny_agent, toy_prompts, out, "--env", "feedback", "--turn-cost", 0.1,
                                   "--batch-size", 8, "--mini-batch-size", 8)  # fmt: skip
    rows, _ = _resumes_exactly("ppo_llm.py", flags, tmp_path, {"TOY_MODEL": tiny_agent})
    # (at this learning rate the policy may answer right the first time after a step or two: turns on step 1)
    # (the value head starts at zero: its rollout values move from step 2 on)
    assert rows[0]["env/turns"] > 1 and all("env/solved_turn" in r for r in rows)
    assert rows[0]["train/value_mean"] == 0 and all(r["train/value_mean"] != 0 for r in rows[1:])
    assert rows[-1]["train/sampler_logprob_diff"] < 1e-4


@pytest.mark.e2e  # in-process, but a tool's whole run (the fast tier's budget)
def test_evaluate_tool_reports_accuracy_with_and_without_the_environment(tiny, toy_prompts, tmp_path, monkeypatch):
    """tools.evaluate --env feedback (in-process): a "<model> + feedback" row next to the plain one, with turns."""
    from tools import evaluate as E

    monkeypatch.setenv("TOY_MODEL", tiny)
    args = E.Args(models=[tiny], data=[toy_prompts], num_prompts=4, max_new_tokens=4, reward_fn=[TOY_REWARD],
                  out=str(tmp_path / "side.md"))  # fmt: skip
    args.env.env, args.env.max_turns = "feedback", 2
    results = E.main(args)
    assert set(results) == {tiny, f"{tiny} + feedback"}
    d = results[f"{tiny} + feedback"]["all"]
    assert d["n"] == 4 and 1 <= d["turns"] <= 2 and 0 <= d["accuracy"] <= 1
    assert "assistant: " in (tmp_path / "side.md").read_text()


@pytest.mark.e2e
def test_grpo_with_the_code_protocol_runs_from_its_flags(tiny_peaky, toy_prompts, tmp_path):
    """--env tools --tool-format code --tools python through grpo_llm.py (issue 68): the system message of the code
    protocol in every prompt, the turns stopped at </code> on the hf engine (a random policy rarely writes one: the
    run, its metrics and its samples are what this checks; tests/unit/test_envs.py checks the stop and the ids)."""
    from conftest import only_run, read_metrics, run_script

    out = tmp_path / "code"
    flags = _env_flags(tiny_peaky, toy_prompts, out, "--env", "tools", "--tool-format", "code", "--tools", "python",
                       "--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--total-steps", 2)  # fmt: skip
    run_script("grpo_llm.py", *flags, env={"TOY_MODEL": tiny_peaky})
    run = only_run(out)
    rows = read_metrics(run)
    assert len(rows) == 2 and all(r["env/errors"] == 0 and "env/tool_calls" in r for r in rows), rows
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("You can run Python" in s["response"] for s in samples if s.get("split") != "eval")
    assert json.loads((run / "args.json").read_text())["tool_format"] == "code"
