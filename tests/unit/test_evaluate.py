"""tools.evaluate: pass@k against brute force, maj@k, --n end to end; per-source eval accuracy in training."""

import itertools

import pytest

from common.harness.eval import majority_correct, pass_at_k


@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (5, 2), (6, 6), (7, 3)])
def test_pass_at_k_matches_enumerating_subsets(n, c):
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)


def test_majority_vote_uses_extracted_answers():
    texts = ["it is 7", "<answer>5</answer>", "so 5", "no idea"]
    assert majority_correct(texts, [0.0, 1.0, 1.0, 0.0], "5") == 1.0  # 5 twice, 7 once; "no idea" has no vote
    assert majority_correct(["7", "7", "5"], [0.0, 0.0, 1.0], "5") == 0.0
    assert majority_correct(["none", "here"], [0.0, 0.0], "abc") == 0.0
