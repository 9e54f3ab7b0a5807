"""Loaders (parquet, jsonl, arrow, several files, verl's schema), bad input messages, sampler, tools."""

import subprocess
import sys

import pandas as pd
import pytest


@pytest.mark.e2e
def test_prepare_and_inspect_cli(tmp_path, tiny):
    out = tmp_path / "data"
    r = subprocess.run(
        [sys.executable, "-m", "tools.prepare_data", "--out", str(out), "--train-size", "20", "--test-size", "5"],
        capture_output=True,
        text=True,
        check=True,
    )
    for task in ("chain_sum_1d", "chain_sum", "basic_arithmetic", "countdown", "leg_counting", "letter_counting"):
        df = pd.read_parquet(out / task / "train.parquet")
        assert len(df) == 20 and df["data_source"].iloc[0] == f"reasoning_gym/{task.replace('_1d', '')}"
        assert "<answer>" in df["prompt"].iloc[0][0]["content"]
    r = subprocess.run(
        [sys.executable, "-m", "tools.inspect_data", str(out / "chain_sum" / "train.parquet"), "--model", tiny],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "reasoning_gym/chain_sum" in r.stdout and "prompt_tokens" in r.stdout and "duplicate_prompts" in r.stdout
    from tools.inspect_data import report

    rep = report([str(out / "chain_sum" / "train.parquet"), str(out / "chain_sum" / "test.parquet")], tiny)
    assert rep["rows"] == 25 and rep["data_source"] == {"reasoning_gym/chain_sum": 25}
