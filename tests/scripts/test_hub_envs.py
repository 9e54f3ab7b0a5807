"""Environments from the hubs (common/integrations/hub_envs.py) against the real libraries: TextArena games played in
process, OpenEnv servers over their own client (an environment made by the real `openenv init`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.harness.args import EnvArgs
from common.integrations import hub_envs as H
from shared_hub_envs import row


def _echo_env(where: Path, sessions: int = 8) -> Path:
    """An OpenEnv environment as its CLI makes one (`openenv init`: the echo environment), serving `sessions`
    WebSocket sessions at once (the template's max_concurrent_envs=1: its comment says to raise it)."""
    # its CLI as `python -m openenv.cli` (the `openenv` script of the same package): wherever this Python is installed
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env"], cwd=where, check=True, capture_output=True,
                   timeout=120)  # fmt: skip
    app = where / "echo_env" / "server" / "app.py"
    assert "max_concurrent_envs=1," in app.read_text()
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", f"max_concurrent_envs={sessions},"))
    return where / "echo_env"


@pytest.mark.e2e
def test_an_openenv_server_is_started_from_its_folder_and_scores_as_it_says(tmp_path):
    url = H.start_openenv_server(_echo_env(tmp_path, sessions=1))
    factory = H.hub_factory(f"openenv:{url}", EnvArgs())
    env = factory()
    assert env.action_key == "message" and "ready" in env.reset(row(3))[0]["content"]
    env.final = False
    step = env.step("hello world", [])
    assert step.observation[0]["content"] == "hello world" and step.reward == pytest.approx(1.1)  # 0.1 per char
    other = factory()  # a second session at once, past the server's one: says what to raise
    with pytest.raises(RuntimeError, match="raise max_concurrent_envs"):
        other.reset(row(4))
    env.final = True
    step = env.step("bye", [])
    assert step.done and step.reward == pytest.approx(0.3) and step.info == {"unfinished": 1.0}
    env.close()


@pytest.mark.e2e
def test_grpo_trains_on_a_textarena_game_from_a_preset_and_evaluates_it_as_its_authors(tiny, tmp_path):
    from conftest import only_run, read_metrics, run_script, run_tool

    preset = tmp_path / "game.yaml"
    preset.write_text("env: textarena:GuessTheNumber-v0-raw\nmax_turns: 3\nmax_trajectory_tokens: 64\n")
    flags = ["--model-name-or-path", tiny, "--config", preset, "--num-prompts", 2, "--group-size", 2,
             "--mini-batch-size", 4, "--micro-batch-size", 4, "--max-new-tokens", 6, "--num-eval-prompts", 2,
             "--eval-every", 2, "--total-steps", 2, "--output-dir", tmp_path / "out"]  # fmt: skip
    env = {"CLEANRLHF_CACHE": str(tmp_path / "cache")}
    run_script("grpo_llm.py", *flags, env=env)
    run = only_run(tmp_path / "out")
    rows = read_metrics(run)
    assert all({"env/win", "env/invalid_move", "env/unfinished", "env/turns"} <= set(r) for r in rows if r["step"] > 0)
    assert {"eval/env/win", "eval/env/unfinished", "eval/reward"} <= set(rows[-1])
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert any("Guess The Number" in s["response"] for s in samples if s.get("split") == "eval")  # the game's text
    out = tmp_path / "eval.json"
    run_tool("tools.evaluate", "--models", run / "checkpoints" / "step_2" / "policy", "--env", "textarena:GuessTheNumber-v0-raw",
             "--max-turns", 2, "--max-new-tokens", 6, "--num-prompts", 2, "--json-out", out, env=env)  # fmt: skip
    res = json.loads(out.read_text())
    with_env = next(v for k, v in res.items() if k.endswith("+ textarena:GuessTheNumber-v0-raw"))
    assert {"reward", "win", "invalid_move", "unfinished"} <= set(with_env["all"]) and with_env["all"]["n"] == 2


@pytest.mark.e2e
def test_grpo_trains_on_an_openenv_environment_folder(tiny, tmp_path):
    from conftest import only_run, read_metrics, run_script

    folder = _echo_env(tmp_path)
    flags = ["--model-name-or-path", tiny, "--env", f"openenv:{folder}", "--max-turns", 2, "--num-prompts", 2,
             "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 4, "--max-new-tokens", 6,
             "--max-trajectory-tokens", 48, "--eval-every", 0, "--total-steps", 2, "--output-dir", tmp_path / "out"]  # fmt: skip
    run_script("grpo_llm.py", *flags, env={"CLEANRLHF_CACHE": str(tmp_path / "cache")})
    run = only_run(tmp_path / "out")
    rows = read_metrics(run)
    # the echo environment pays 0.1 per character of each turn and never ends: every trajectory unfinished
    assert all(r["env/errors"] == 0 and r["env/unfinished"] == 1.0 and r["train/reward"] > 0 for r in rows)
    for s in map(json.loads, (run / "samples.jsonl").read_text().splitlines()):  # its reward, from the turns' text
        turns = [t.removeprefix("assistant: ") for t in s["response"].split("\n") if t.startswith("assistant: ")]
        assert s["reward"] == pytest.approx(0.1 * sum(len(t) for t in turns), abs=1e-4), s


@pytest.mark.e2e
def test_a_textarena_run_resumes_exactly_with_the_env_in_workers(tiny, tmp_path):
    """3 steps straight == its step-1 checkpoint resumed for steps 2-3: the sampler's seed rows, the games' seeds and
    the environment's metrics come back the same (each game in a worker process, as by default)."""
    from shared_envs import _resumes_exactly

    cache = {"CLEANRLHF_CACHE": str(tmp_path / "cache")}
    flags = lambda out: ["--model-name-or-path", tiny, "--env", "textarena:GuessTheNumber-v0-raw", "--max-turns", 3,
                         "--max-trajectory-tokens", 48, "--max-new-tokens", 6, "--num-prompts", 2, "--group-size", 2,
                         "--mini-batch-size", 4, "--micro-batch-size", 4, "--learning-rate", 3e-3, "--eval-every", 0,
                         "--output-dir", out]  # fmt: skip
    rows, _ = _resumes_exactly("grpo_llm.py", flags, tmp_path, cache)
    assert all("env/unfinished" in r and r["env/errors"] == 0 for r in rows)
