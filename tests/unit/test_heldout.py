"""benchmarks/heldout.py: McNemar's exact test, the most-common-answer baseline, and one run end to end."""

import sys
from itertools import product

import heldout  # noqa: E402
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


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
