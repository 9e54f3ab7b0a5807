"""tools.compare on synthetic run folders."""

import json

import pytest

from shared_compare import fake_run
from tools.compare import Args, load_run, main


def test_compare_png_and_table(tmp_path):
    a1 = fake_run(tmp_path, "ppo_llm__a__1__1", "a", 1, [0.0, 0.5, 1.0])
    a2 = fake_run(tmp_path, "ppo_llm__a__2__1", "a", 2, [0.2, 0.3, 0.6])
    b = fake_run(tmp_path, "grpo_llm__b__1__1", "b", 1, [0.1, 0.9, 0.4])
    out = tmp_path / "c.png"
    table = main(
        Args(runs=[str(a1), str(a2), str(b)], metrics=["train/reward", "train/kl", "eval/nothing"], out=str(out))
    )
    assert out.exists() and out.stat().st_size > 1000
    rows = {(r["group"], r["metric"]): r for r in table}
    assert len(table) == 4  # 2 groups x 2 present metrics
    ra = rows[("ppo_llm:a", "train/reward")]
    assert ra["seeds"] == 2 and ra["final"] == pytest.approx(0.8) and ra["best"] == pytest.approx(0.8)
    assert ra["steps"] == 3 and ra["seconds"] == pytest.approx(6.0)
    rb = rows[("grpo_llm:b", "train/reward")]
    assert rb["final"] == pytest.approx(0.4) and rb["best"] == pytest.approx(0.9)
    assert rows[("grpo_llm:b", "train/kl")]["best"] == pytest.approx(0.1)  # lower is better for KL


def test_curves_align_by_x_not_by_row():
    import numpy as np

    from tools.compare import align

    # seed 2 logged every 2 steps and crashed after step 4; seed 1 logged every step to 5
    a = (np.array([1.0, 2, 3, 4, 5]), np.array([10.0, 20, 30, 40, 50]))
    b = (np.array([2.0, 4]), np.array([2.0, 4]))
    xs, ys = align([a, b], "step")
    assert xs.tolist() == [2.0, 4.0] and ys.tolist() == [[20.0, 40.0], [2.0, 4.0]]  # by row index: [10, 20] vs [2, 4]
    xs, ys = align([a, (np.array([1.5, 3.5]), np.array([0.0, 1.0]))], "time")  # interpolated inside the shared range
    assert xs.min() >= 1.5 and xs.max() <= 3.5 and ys[0].tolist() == [15.0, 20.0, 30.0, 35.0]


def test_a_step_logged_twice_counts_once(tmp_path):
    d = fake_run(tmp_path, "ppo_llm__a__1__1", "a", 1, [0.0, 0.5, 1.0])
    with open(d / "metrics.jsonl", "a") as f:  # an old-style resume appended step 3 again
        f.write(json.dumps({"step": 3, "train/reward": 0.7}) + "\n")
    rows = load_run(d)["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["train/reward"] == 0.7
