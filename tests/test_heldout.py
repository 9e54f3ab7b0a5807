"""benchmarks/heldout.py: McNemar's exact test, the most-common-answer baseline, and one run end to end."""

import json
import subprocess
import sys
from itertools import product

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import heldout  # noqa: E402


def _mcnemar_by_enumeration(b: int, c: int) -> float:
    """Two-sided exact McNemar by brute force: the probability, over all 2^(b+c) equally likely sign
    assignments of the discordant pairs, of a split at least as uneven as (b, c)."""
    n = b + c
    if n == 0:
        return 1.0
    extreme = abs(b - c)
    hits = sum(1 for signs in product((0, 1), repeat=n) if abs(2 * sum(signs) - n) >= extreme)
    return hits / 2**n


@pytest.mark.parametrize("b,c", [(0, 0), (3, 0), (10, 2), (2, 10), (5, 5), (7, 3), (12, 1), (0, 9)])
def test_mcnemar_exact_equals_enumeration(b, c):
    # paired answers with b wrong->right, c right->wrong and some concordant pairs of each kind
    before = [False] * b + [True] * c + [True] * 4 + [False] * 3
    after = [True] * b + [False] * c + [True] * 4 + [False] * 3
    got_b, got_c, p = heldout.mcnemar_exact(before, after)
    assert (got_b, got_c) == (b, c)
    assert p == pytest.approx(_mcnemar_by_enumeration(b, c), abs=1e-12)


def test_mcnemar_known_value_and_length_check():
    # b=10, c=2: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 2 * 79 / 4096
    assert heldout.mcnemar_exact([False] * 10 + [True] * 2, [True] * 10 + [False] * 2)[2] == pytest.approx(158 / 4096)
    with pytest.raises(ValueError, match="differ in length"):
        heldout.mcnemar_exact([True], [True, False])


def test_majority_answer_accuracy():
    def r(gt):
        return {"reward_model": {"ground_truth": gt}}

    train = [r("1"), r("1"), r("2"), r(3), r("1")]
    test = [r("1"), r("2"), r("1"), r("4")]
    assert heldout.majority_answer_accuracy(train, test) == ("1", 0.5)


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
