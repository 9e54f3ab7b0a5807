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
    from common.core.data import write_rows
    from common.core.tasks import reasoning_gym_rows

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


def _tensorboard_scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for events in sorted(glob.glob(f"{folder}/**/events.out.tfevents.*", recursive=True)):  # a resume adds a file
        acc = EventAccumulator(events)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


@pytest.mark.e2e
def test_tensorboard_and_mlflow_hold_what_metrics_jsonl_holds_across_a_resume(tiny_peaky, toy_prompts, tmp_path):
    """--report-to tensorboard,mlflow (issue 37.2), 2 steps then --resume to 4: TensorBoard's event files and the
    MLflow file store (runs/mlruns) read back give metrics.jsonl's values at every step, in one MLflow run."""
    import os

    from mlflow.tracking import MlflowClient

    flags = lambda n: [
        "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--reward-fn",
        f"{REPO}/tests/helpers/toy_reward.py:compute_score", "--output-dir", tmp_path, "--total-steps", n, "--num-prompts", 2,
        "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 4, "--max-new-tokens", 4, "--eval-every",
        0, "--report-to", "tensorboard,mlflow", "--exp-name", "trk",
    ]  # fmt: skip
    env = {"TOY_MODEL": tiny_peaky, "MLFLOW_TRACKING_URI": ""}
    run_script("grpo_llm.py", *flags(2), env=env)
    (run,) = tmp_path.glob("grpo_llm__*")  # beside it: mlruns/, the MLflow file store
    run_script("grpo_llm.py", *flags(4), "--resume", run, env=env)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    tb = _tensorboard_scalars(run / "tensorboard")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(f"file:{(tmp_path / 'mlruns').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("trk").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == run.name  # the resume continued the same MLflow run
    assert runs[0].data.params["total_steps"] == "2"  # the flags as the fresh run had them
    for key in ("train/reward", "train/kl", "loss/policy", "train/entropy"):
        want = {r["step"]: r[key] for r in rows}
        got_tb = tb[key]
        got_mlflow = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}
        assert got_tb == pytest.approx(want, rel=1e-6) and got_mlflow == pytest.approx(want, rel=1e-6), key
