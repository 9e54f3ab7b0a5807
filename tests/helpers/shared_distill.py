"""What the tests of test_distill.py share (tests/*/test_distill.py: the tiers, and other test modules)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # (not conftest's: a launched child imports this module too)

sys.path.insert(0, str(REPO / "algos"))

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def _flags(student, teacher, prompts, out, *extra):
    return [
        "--model-name-or-path", student, "--teacher", teacher, "--train-files", prompts, "--val-files", prompts,
        "--reward-fn", TOY_REWARD, "--output-dir", out, "--num-prompts", 8, "--samples-per-prompt", 2,
        "--micro-batch-size", 8, "--max-new-tokens", 6, "--num-eval-prompts", 8, *extra,
    ]  # fmt: skip
