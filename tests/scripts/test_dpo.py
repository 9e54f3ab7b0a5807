"""algos/dpo_llm.py: losses by hand, offline and online end to end, learning a toy preference, resume;
tools.gen_preferences."""

import math
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


@pytest.fixture(scope="module")
def toy_pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pairs")
    rows = [{"prompt": f"Say yes or no ({i})", "chosen": "yes indeed", "rejected": "no way"} for i in range(48)]
    pd.DataFrame(rows[:40]).to_parquet(d / "train.parquet")
    pd.DataFrame(rows[40:]).to_parquet(d / "test.parquet")
    return str(d / "train.parquet"), str(d / "test.parquet")


@pytest.mark.e2e
def test_offline_end_to_end_and_learns_toy_preference(tiny, toy_pairs, tmp_path):
    run_script(
        "dpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_pairs[0],
        "--val-files",
        toy_pairs[1],
        "--output-dir",
        tmp_path,
        "--total-steps",
        10,
        "--batch-size",
        8,
        "--micro-batch-size",
        4,
        "--learning-rate",
        1e-3,
        "--beta",
        0.5,
        "--eval-every",
        10,
        "--precompute-ref",
        "--sft-coef",
        0.1,
    )
    run = only_run(tmp_path)
    rows = read_metrics(run)
    for key in (
        "loss/policy",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracy",
        "rewards/margin",
        "train/logps_chosen",
        "train/logps_rejected",
        "perf/step_s",
    ):
        assert key in rows[1], key
    assert rows[1]["loss/policy"] == pytest.approx(math.log(2), abs=1e-4)  # step 1: policy == reference
    assert rows[0]["eval/rewards_accuracy"] == 0.0  # margins are exactly 0 before training
    assert rows[-1]["eval/rewards_accuracy"] > 0.9 and min(r["rewards/accuracy"] for r in rows[-3:]) > 0.9
    assert (run / "checkpoints" / "step_10" / "policy" / "model.safetensors").exists()


@pytest.mark.e2e
def test_online_end_to_end(tiny_peaky, toy_prompts, tmp_path):
    run_script(
        "dpo_llm.py",
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--online",
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        tmp_path,
        "--total-steps",
        2,
        "--batch-size",
        2,
        "--micro-batch-size",
        1,
        "--group-size",
        3,
        "--max-new-tokens",
        6,
        "--eval-every",
        0,
        "--lora-r",
        4,
        env={"TOY_MODEL": tiny_peaky},
    )
    rows = read_metrics(only_run(tmp_path))
    assert all("train/skipped_ties" in r and "train/reward" in r for r in rows)
    assert sum(r["train/pairs"] for r in rows) + sum(r["train/skipped_ties"] for r in rows) == 4
    assert any("rewards/accuracy" in r for r in rows)


@pytest.mark.e2e
def test_resume_gives_identical_metrics(tiny, toy_pairs, tmp_path):
    flags = lambda out, n: [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_pairs[0],
        "--val-files",
        toy_pairs[1],
        "--output-dir",
        out,
        "--total-steps",
        n,
        "--batch-size",
        4,
        "--micro-batch-size",
        2,
        "--learning-rate",
        1e-3,
        "--eval-every",
        2,
        "--num-eval-pairs",
        4,
    ]
    run_script("dpo_llm.py", *flags(tmp_path / "a", 4))
    run_script("dpo_llm.py", *flags(tmp_path / "b", 2))
    first = only_run(tmp_path / "b")
    run_script("dpo_llm.py", *flags(tmp_path / "c", 4), "--resume", first)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    straight = strip(read_metrics(only_run(tmp_path / "a")))
    assert straight[-1]["rewards/margin"] != 0 and straight == strip(read_metrics(first))


@pytest.mark.e2e
def test_gen_preferences_writes_pairs_and_reports_ties(tiny_peaky, toy_prompts, tmp_path):
    out = tmp_path / "pairs.parquet"
    import os

    cmd = [
        sys.executable,
        "-m",
        "tools.gen_preferences",
        "--prompts",
        toy_prompts,
        "--model",
        tiny_peaky,
        "--group-size",
        "3",
        "--max-new-tokens",
        "6",
        "--num-prompts",
        "8",
        "--reward-fn",
        TOY_REWARD,
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "TOY_MODEL": tiny_peaky})
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(out)
    assert len(df) > 0 and (df["chosen_score"] > df["rejected_score"]).all()
    assert "'tied':" in r.stdout and f"'pairs': {len(df)}" in r.stdout
