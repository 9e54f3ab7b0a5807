"""tools.compare on synthetic run folders."""

import subprocess
import sys

import pytest

from common.core.errors import UserError
from shared_compare import fake_run
from tools.compare import load_run, smooth


@pytest.mark.e2e
def test_panels_and_cli(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image

    a = fake_run(tmp_path, "ppo_llm__a__1__1", "a", 1, [0.0, 0.5, 1.0])
    out = tmp_path / "p.png"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.compare",
            str(a),
            "--metrics",
            "train/reward",
            "train/kl",
            "--x",
            "time",
            "--smooth",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "train/reward" in r.stdout and out.exists()
    h, w, _ = image.imread(out).shape
    assert w > h  # two panels side by side
    assert smooth(__import__("numpy").array([0.0, 2.0, 4.0]), 2).tolist() == [0.0, 1.0, 3.0]
    with pytest.raises(UserError, match="no metrics.jsonl"):
        load_run(tmp_path)
