"""algos/dynamic_kl_ppo.py: the beta rule, end to end, exact resume (beta included), and the diff stays small."""

import subprocess
import sys

import dynamic_kl_ppo as D  # noqa: E402
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def test_beta_rule_band_and_bounds():
    target = 0.1
    assert D.update_beta(0.5, 0.2, target, 0.01, 1.0) == pytest.approx(0.75)  # above 1.5 x target: x1.5
    assert D.update_beta(0.8, 0.2, target, 0.01, 1.0) == 1.0  # capped at beta_max
    assert D.update_beta(0.5, 0.1, target, 0.01, 1.0) == 0.5  # inside the band: unchanged
    assert D.update_beta(0.5, 0.15, target, 0.01, 1.0) == 0.5  # edge of the band: unchanged
    assert D.update_beta(0.5, 0.05, target, 0.01, 1.0) == 0.5  # lower edge: unchanged
    assert D.update_beta(0.5, 0.01, target, 0.01, 1.0) == pytest.approx(0.25)  # below 0.5 x target: x0.5
    assert D.update_beta(0.015, 0.0, target, 0.01, 1.0) == 0.01  # floored at beta_min
    beta = 0.5
    for kl in [1.0] * 10:
        beta = D.update_beta(beta, kl, target, 0.01, 1.0)
    assert beta == 1.0


def test_diff_against_ppo_stays_small():
    out = subprocess.run(
        ["diff", str(REPO / "algos/ppo_llm.py"), str(REPO / "algos/dynamic_kl_ppo.py")], capture_output=True, text=True
    ).stdout
    changed = [l for l in out.splitlines() if l[:1] in "<>"]
    assert 0 < len(changed) <= 80, len(changed)
