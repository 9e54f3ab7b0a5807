"""W&B the CleanRL way (--track, offline here) and side-by-side evaluation of two models."""

import glob
import json
import subprocess
import sys

import pytest

from conftest import REPO, only_run, run_script


@pytest.mark.e2e
def test_wandb_offline_run_holds_the_logged_keys(tiny, tmp_path):
    run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--output-dir",
        tmp_path,
        "--total-steps",
        2,
        "--track",
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        4,
        "--eval-every",
        2,
        "--num-eval-prompts",
        2,
        env={"WANDB_MODE": "offline", "WANDB_TAGS": "sweep-a"},
    )
    run = only_run(tmp_path)
    files = glob.glob(str(run / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(files) == 1
    blob = open(files[0], "rb").read()  # protobuf records: the keys, tags and names appear verbatim
    for key in (
        "train/reward",
        "train/zero_std_groups",
        "eval/accuracy",
        "train/step",
        "samples",
        run.name,
        "sweep-a",
        "commit-",
    ):
        assert key.encode() in blob, key
    assert (run / "metrics.jsonl").exists()  # the local log is written with W&B too


@pytest.mark.e2e
def test_evaluate_two_models_side_by_side(tiny, tiny_peaky, tmp_path):
    from common.data import write_rows
    from common.tasks import reasoning_gym_rows

    data = tmp_path / "test.parquet"
    write_rows(reasoning_gym_rows("chain_sum", 4, 5, "test"), data)
    out, js = tmp_path / "side.md", tmp_path / "scores.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.evaluate",
            "--models",
            tiny,
            tiny_peaky,
            "--data",
            str(data),
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            "--json-out",
            str(js),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert text.count(f"**{tiny}**") == 4 and text.count(f"**{tiny_peaky}**") == 4  # both answers per prompt
    scores = json.loads(js.read_text())
    assert set(scores) == {tiny, tiny_peaky}
    assert scores[tiny]["reasoning_gym/chain_sum"]["n"] == 4 and "accuracy" in scores[tiny]["all"]
