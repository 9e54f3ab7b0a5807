"""Two CPU processes over gloo through `accelerate launch` (configs/accelerate/cpu_2proc.yaml)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, only_run, read_metrics

TOY_REWARD = f"{REPO}/tests/toy_reward.py:compute_score"


def launch(script, *flags, env=None):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
           str(REPO / "algos" / script), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("script,sizes", [
    ("ppo_llm.py", ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1]),
    ("grpo_llm.py", ["--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 1]),
    ("dynamic_kl_ppo.py", ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1]),
])
def test_two_processes(script, sizes, tiny_peaky, toy_prompts, tmp_path):
    launch(script, "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--val-files", toy_prompts,
           "--reward-fn", TOY_REWARD, "--output-dir", tmp_path, "--total-steps", 2, "--eval-every", 2,
           "--num-eval-prompts", 4, "--max-new-tokens", 6, "--learning-rate", 1e-3, *sizes, env={"TOY_MODEL": tiny_peaky})
    run = only_run(tmp_path)  # one run folder, written by the main process only
    assert json.loads((run / "args.json").read_text())["world_size"] == 2  # two processes really ran
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1]
    assert (run / "checkpoints" / "step_2" / "policy" / "model.safetensors").exists()


def test_batch_not_divisible_by_processes_names_the_flag(tiny, tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
           str(REPO / "algos/ppo_llm.py"), "--model-name-or-path", tiny, "--output-dir", str(tmp_path),
           "--batch-size", "3", "--mini-batch-size", "3", "--micro-batch-size", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--batch-size over the number of processes: 3 is not divisible by 2" in proc.stderr
