"""tools.evaluate: pass@k against brute force, maj@k, --n end to end; per-source eval accuracy in training."""

import json
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.e2e
def test_evaluate_n_samples_reports_pass_and_maj(tiny, tmp_path):
    rows = [
        {
            "prompt": f"What is {i} + 1?",
            "data_source": "match" if i % 2 else "gsm8k",
            "reward_model": {"ground_truth": "x"},
        }
        for i in range(4)
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.evaluate",
            "--models",
            tiny,
            "--data",
            str(tmp_path / "p.jsonl"),
            "--n",
            "3",
            "--max-new-tokens",
            "3",
            "--json-out",
            str(tmp_path / "r.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())[tiny]
    for src in ("all", "match", "gsm8k"):
        assert {"accuracy", "pass@1", "pass@2", "pass@3", "maj@3"} <= set(res[src])
        assert 0.0 <= res[src]["pass@1"] <= res[src]["pass@3"] <= 1.0


@pytest.mark.e2e
def test_training_eval_per_source_and_save_best(tiny, toy_prompts, tmp_path):
    from conftest import only_run, read_metrics, run_script

    rows = [json.loads(line) for line in open(toy_prompts)][:4]
    for i, r in enumerate(rows):
        r["data_source"] = "toy" if i % 2 else "toy2"
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--val-files",
        tmp_path / "val.jsonl",
        "--reward-fn",
        f"{REPO}/tests/helpers/toy_reward.py:compute_score",
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
        "--total-steps",
        2,
        "--eval-every",
        1,
        "--save-best",
        "eval/reward",
        "--output-dir",
        tmp_path / "run",
        env={"TOY_MODEL": tiny},
    )
    run = only_run(tmp_path / "run")
    last = read_metrics(run)[-1]
    assert {"eval/accuracy/toy", "eval/accuracy/toy2"} <= set(last)
    assert (run / "checkpoints/best/policy/config.json").exists() and (run / "checkpoints/step_2").exists()
    import torch

    state = torch.load(run / "checkpoints/best/trainer_state.pt", weights_only=True)
    evals = [r["eval/reward"] for r in read_metrics(run) if r["step"] > 0]
    assert (
        state["best"]["best"] == max(evals)
        and state["algo"] == "grpo_llm"
        and state["args"]["save_best"] == "eval/reward"
    )
