"""benchmarks/heldout.py: McNemar's exact test, the most-common-answer baseline, and one run end to end."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.e2e
def test_heldout_end_to_end_on_a_tiny_model(tiny, tmp_path):
    """Trains GRPO on the built-in task for one step (budget passed at once), then scores the base model
    and the checkpoint on a test split disjoint by problem from the training file: one JSON line."""
    out = tmp_path / "results.jsonl"
    flags = f"--model-name-or-path {tiny} --num-prompts 2 --group-size 2 --mini-batch-size 4 --micro-batch-size 4 --max-new-tokens 4 --eval-every 0"
    cmd = [sys.executable, str(REPO / "benchmarks" / "heldout.py"), "--algos", "grpo", "--tasks", "chain_sum_1d"]
    cmd += ["--minutes", "1e-6", "--test-size", "8", "--tag", "t", "--script-args", flags]
    cmd += ["--output-dir", str(tmp_path / "runs"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (r,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert r["task"] == "chain_sum_1d" and r["script"] == "grpo_llm" and r["steps"] == 1
    assert r["test_questions"] == 8 and r["test_problems_in_train"] == 0 and r["max_new_tokens"] == 4
    assert 0.0 <= r["before"] <= 1.0 and 0.0 <= r["p_mcnemar"] <= 1.0
    assert "| chain_sum_1d | grpo_llm | t | 1 | 1 |" in proc.stdout
