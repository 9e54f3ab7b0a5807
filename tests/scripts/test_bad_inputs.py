"""User errors end in one line and exit code 2 with nothing written; a stopped run resumes exactly.

A first part of the reliability catalogue (issue 17): each row runs a script as a user would, with one
mistake, and checks the message names the culprit, the exit code is 2 and no run folder was created.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import REPO, only_run, read_metrics, run_script
from shared_bad_inputs import _Payload

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


HUNG_ENV = """import signal, time

from common.core.envs import Environment


class Env(Environment):
    def step(self, text, ids):  # deaf to the timeout's signals, then asleep for good
        for s in (signal.SIGALRM, signal.SIGRTMIN + 3):
            signal.signal(s, signal.SIG_IGN)
        time.sleep(10000)
"""


def processes_marked(marker: str) -> list[int]:
    """The live processes whose environment holds `marker` (a run's processes inherit its environment)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.e2e
def test_user_error_from_the_command_line(tiny, tmp_path):
    """The same as users see it, in a fresh process: one line on stderr, exit code 2, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "algos/ppo_llm.py"),
            "--model-name-or-path",
            tiny,
            "--kl-target",
            "0",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = [
        line for line in proc.stderr.strip().splitlines() if "gemm_4bit" not in line and "real_accelerator" not in line
    ]
    assert proc.returncode == 2 and len(err) == 1 and "--kl-target 0" in err[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_yaml_preset_errors_name_the_file(tmp_path):
    for text, fragment in (
        ("learning_rat: 1\n", "unknown key 'learning_rat'"),
        ("[1, 2]\n", "expected a mapping"),
        ("a: [\n", "not valid YAML"),
    ):
        (tmp_path / "p.yaml").write_text(text)
        proc = run_script("ppo_llm.py", "--config", tmp_path / "p.yaml", timeout=120, check=False)
        assert proc.returncode == 2 and fragment in proc.stderr and "p.yaml" in proc.stderr, proc.stderr[-1000:]


@pytest.mark.e2e
def test_debug_env_shows_the_traceback(tiny, tmp_path):
    proc = run_script("ppo_llm.py", "--model-name-or-path", tiny, "--kl-target", 0, "--output-dir", tmp_path,
                      env={"CLEANRLHF_DEBUG": "1"}, timeout=300, check=False)  # fmt: skip
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "UserError" in proc.stderr


@pytest.mark.e2e
def test_sigterm_checkpoints_and_resume_matches_uninterrupted(tiny_peaky, toy_prompts, tmp_path):
    flags = [
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        6,
        "--eval-every",
        0,
        "--learning-rate",
        3e-3,
        "--total-steps",
        8,
    ]
    env = {"TOY_MODEL": tiny_peaky}
    run_script("grpo_llm.py", *flags, "--output-dir", tmp_path / "straight", env=env)
    cmd = [sys.executable, str(REPO / "algos/grpo_llm.py"), *map(str, flags), "--output-dir", str(tmp_path / "stopped")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    for line in proc.stdout:
        if line.startswith("step 3:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Resume with" in out and "--resume" in out
    run = only_run(tmp_path / "stopped")
    stopped_at = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert 3 <= stopped_at < 8
    run_script("grpo_llm.py", *flags, "--output-dir", tmp_path / "stopped", "--resume", run, env=env)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    assert strip(read_metrics(run)) == strip(read_metrics(only_run(tmp_path / "straight")))
    assert json.loads((run / "args.json").read_text())["resumes"][0]["from_step"] == stopped_at


@pytest.mark.e2e
def test_max_wall_minutes_ends_the_run_like_total_steps(tiny, toy_prompts, tmp_path):
    """A budget that the first step already passes: that step is the last; it is checkpointed and
    evaluated as a --total-steps end would be, and the run exits 0; --resume continues from it."""
    flags = [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--val-files",
        toy_prompts,
        "--num-eval-prompts",
        4,
        "--reward-fn",
        TOY_REWARD,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        4,
        "--max-new-tokens",
        4,
        "--eval-every",
        10,
    ]
    run_script(
        "grpo_llm.py",
        *flags,
        "--total-steps",
        5,
        "--max-wall-minutes",
        1e-6,
        "--output-dir",
        tmp_path,
        env={"TOY_MODEL": tiny},
    )
    run = only_run(tmp_path)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    run_script(
        "grpo_llm.py", *flags, "--total-steps", 2, "--output-dir", tmp_path, "--resume", run, env={"TOY_MODEL": tiny}
    )
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2]


@pytest.mark.e2e
def test_non_finite_updates_are_skipped_and_never_saved(tiny, toy_prompts, tmp_path):
    """A reward of +-3e38 overflows the loss: every update is skipped and counted, the health check
    fires, the checkpoint holds the untouched (finite) weights; 5 in a row stop the run with exit 2."""
    (tmp_path / "huge.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 3e38 if len(solution_str) % 2 else -3e38\n"
    )
    flags = [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        f"{tmp_path}/huge.py:score",
        "--num-prompts",
        2,
        "--group-size",
        4,
        "--mini-batch-size",
        8,
        "--micro-batch-size",
        4,
        "--max-new-tokens",
        5,
        "--eval-every",
        0,
        "--scale-rewards",
        "none",
        "--loss-agg",
        "token-mean",
    ]
    proc = run_script("grpo_llm.py", *flags, "--total-steps", 2, "--output-dir", tmp_path / "a")
    run = only_run(tmp_path / "a")
    rows = read_metrics(run)
    assert rows[-1]["train/skipped_steps"] == 2 and rows[0].get("health/reward_scale") == 1.0
    assert "update skipped" in proc.stdout
    import torch
    from safetensors.torch import load_file

    saved, base = load_file(run / "checkpoints/step_2/policy/model.safetensors"), load_file(f"{tiny}/model.safetensors")
    assert all(torch.isfinite(v).all() and torch.equal(v, base[k]) for k, v in saved.items())
    proc = run_script(
        "grpo_llm.py", *flags, "--total-steps", 8, "--save-every", 2, "--output-dir", tmp_path / "b", check=False
    )
    assert proc.returncode == 2 and "non-finite policy gradient norm in 5 updates in a row" in proc.stderr
    assert (only_run(tmp_path / "b") / "checkpoints/step_4/policy").is_dir()  # the last checkpoint is intact


@pytest.mark.e2e
def test_planted_pickle_payloads_never_run(tiny, toy_prompts, tmp_path):
    import torch

    flags = [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        3,
        "--eval-every",
        0,
    ]
    run_script("grpo_llm.py", *flags, "--total-steps", 1, "--output-dir", tmp_path / "run", env={"TOY_MODEL": tiny})
    ckpt = only_run(tmp_path / "run") / "checkpoints/step_1"
    marker = tmp_path / "PWNED"
    torch.save({"step": 1, "x": _Payload(marker)}, ckpt / "trainer_state.pt")  # ours: weights_only=True
    proc = run_script(
        "grpo_llm.py",
        *flags,
        "--total-steps",
        2,
        "--output-dir",
        tmp_path / "run",
        "--resume",
        ckpt,
        env={"TOY_MODEL": tiny},
        check=False,
    )
    assert proc.returncode == 2 and "refusing to load it" in proc.stderr and not marker.exists(), proc.stderr[-1500:]
    # model weights are safetensors: a pickle in their place is a format error, never executed
    torch.save(_Payload(marker), ckpt / "policy" / "model.safetensors")
    from common.core import models as M
    from common.harness.checkpoint import load_weights

    with pytest.raises(Exception):
        load_weights(M.load_causal_lm(tiny), ckpt / "policy")
    assert not marker.exists()


@pytest.mark.e2e
def test_runs_on_a_hung_environment_or_a_hung_service_leave_no_process(tiny, toy_prompts, tmp_path):
    """A GRPO run whose environment hangs in its step, deaf to signals (in a worker: killed at --env-timeout),
    and one whose reward service accepts and never answers (each request bounded by --service-timeout, then
    --reward-fallback): each finishes its step, and no process it started outlives it. Each run's environment
    carries a marker, looked for in /proc after it ends (a fresh process: a zygote child's /proc environ is the
    zygote's)."""
    import socket
    import threading
    import time

    (tmp_path / "hung.py").write_text(HUNG_ENV)
    server, held = socket.socket(), []
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in iter(int, 1)], daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}/score"
    base = ["--model-name-or-path", tiny, "--train-files", toy_prompts, "--num-prompts", 2, "--group-size", 2,
            "--mini-batch-size", 4, "--micro-batch-size", 4, "--max-new-tokens", 4, "--eval-every", 0,
            "--total-steps", 1]  # fmt: skip
    runs = {
        "environment": [
            "--reward-fn",
            TOY_REWARD,
            "--env",
            f"{tmp_path}/hung.py:Env",
            "--env-timeout",
            1,
            "--max-turns",
            2,
        ],  # fmt: skip
        "service": [
            "--reward",
            "remote:1.0",
            "--reward-url",
            url,
            "--service-timeout",
            1,
            "--service-retries",
            0,
            "--reward-fallback",
            0,
        ],  # fmt: skip
    }
    try:
        for name, flags in runs.items():
            marker = f"CLEANRLHF_TEST_RUN={tmp_path / name}"
            proc = run_script("grpo_llm.py", *base, *flags, "--output-dir", tmp_path / name, fresh=True,
                              env={"TOY_MODEL": tiny, "CLEANRLHF_TEST_RUN": str(tmp_path / name)})  # fmt: skip
            metrics = read_metrics(only_run(tmp_path / name))
            errors = metrics[-1]["env/errors" if name == "environment" else "reward/errors"]
            assert metrics[-1]["step"] == 1 and errors > 0, (name, metrics[-1])
            time.sleep(1)
            assert not processes_marked(marker), (name, processes_marked(marker), proc.stderr[-2000:])
        assert held  # the service was called (and never answered)
    finally:
        server.close()
