"""algos/sft_llm.py and algos/rm_llm.py: prompt masking, end to end, learning, normalisation, PPO with the trained
RM."""

import json
import sys

import pandas as pd
import pytest
import torch

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))


@pytest.fixture(scope="module")
def toy_sft(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Say the magic word ({i})"},
                {"role": "assistant", "content": "banana"},
            ]
        }
        for i in range(40)
    ]
    pd.DataFrame(rows[:32]).to_json(d / "train.jsonl", orient="records", lines=True)
    pd.DataFrame(rows[32:]).to_json(d / "test.jsonl", orient="records", lines=True)
    return str(d / "train.jsonl"), str(d / "test.jsonl")


@pytest.fixture(scope="module")
def toy_pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm_pairs")
    rows = [{"prompt": f"Question {i}?", "chosen": "yes indeed", "rejected": "no way"} for i in range(48)]
    pd.DataFrame(rows[:40]).to_parquet(d / "train.parquet")
    pd.DataFrame(rows[40:]).to_parquet(d / "test.parquet")
    return str(d / "train.parquet"), str(d / "test.parquet")


@pytest.mark.e2e
def test_sft_learns_and_resumes(tiny, toy_sft, tmp_path):
    flags = lambda out, n: [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_sft[0],
        "--val-files",
        toy_sft[1],
        "--output-dir",
        out,
        "--total-steps",
        n,
        "--batch-size",
        8,
        "--micro-batch-size",
        4,
        "--learning-rate",
        3e-3,
        "--warmup-steps",
        0,
        "--lr-scheduler",
        "constant",
        "--eval-every",
        4,
    ]
    run_script("sft_llm.py", *flags(tmp_path / "a", 8))
    rows = read_metrics(only_run(tmp_path / "a"))
    assert rows[-1]["eval/loss"] < 0.75 * rows[0]["eval/loss"], rows  # learning the response (10.8 -> 7.5 here)
    run_script("sft_llm.py", *flags(tmp_path / "b", 4))
    first = only_run(tmp_path / "b")
    run_script("sft_llm.py", *flags(tmp_path / "c", 8), "--resume", first)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs]
    assert strip(rows) == strip(read_metrics(first))


@pytest.mark.e2e
def test_sft_default_task_with_lora(tiny, tmp_path):
    run_script(
        "sft_llm.py",
        "--model-name-or-path",
        tiny,
        "--output-dir",
        tmp_path,
        "--total-steps",
        2,
        "--batch-size",
        4,
        "--micro-batch-size",
        2,
        "--lora-r",
        4,
        "--eval-every",
        2,
        "--num-eval-prompts",
        4,
        "--num-eval-examples",
        4,
        "--max-new-tokens",
        4,
    )
    rows = read_metrics(only_run(tmp_path))
    assert "eval/accuracy" in rows[-1] and "eval/loss" in rows[-1]


@pytest.mark.e2e
def test_rm_learns_normalises_and_feeds_ppo(tiny, toy_pairs, toy_prompts, tmp_path):
    run_script(
        "rm_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_pairs[0],
        "--val-files",
        toy_pairs[1],
        "--output-dir",
        tmp_path / "rm",
        "--total-steps",
        10,
        "--batch-size",
        8,
        "--micro-batch-size",
        4,
        "--learning-rate",
        1e-3,
        "--warmup-steps",
        0,
        "--eval-every",
        10,
        "--num-norm-samples",
        32,
    )
    run = only_run(tmp_path / "rm")
    rows = read_metrics(run)
    assert rows[0]["eval/rm_accuracy"] <= 0.5 + 1e-9 or rows[0]["eval/rm_accuracy"] < rows[-2]["eval/rm_accuracy"]
    final = [r for r in rows if "eval/rm_accuracy" in r][-1]
    assert final["eval/rm_accuracy"] > 0.9
    norm = rows[-1]
    assert abs(norm["rm/norm_mean"]) < 1e-4 and norm["rm/norm_std"] == pytest.approx(1.0, abs=1e-4)
    # the saved folder, loaded as users do, reproduces the normalised scores
    from common.core.chat import load_tokenizer
    from common.core.data import PromptRow, load_preferences
    from common.core.models import load_reward_model
    from common.core.rewards import Reward

    rm_dir = run / "reward_model"
    tok = load_tokenizer(str(rm_dir))
    rm = load_reward_model(str(rm_dir), tok).eval()
    cfg = json.loads((rm_dir / "config.json").read_text())
    assert "reward_gain" in cfg and "reward_bias" in cfg
    pairs = load_preferences([toy_pairs[0]], tok)[:32]
    rw = Reward("model:1.0", reward_model=rm, reward_tok=tok)
    rows_ = [PromptRow(p["prompt"], "x", None, {}, i) for i, p in enumerate(pairs)] * 2
    s, _, _ = rw(
        rows_,
        [p["chosen"] + tok.eos_token for p in pairs] + [p["rejected"] + tok.eos_token for p in pairs],
        torch.ones(64),
    )
    assert abs(s.mean().item()) < 1e-3 and s.std().item() == pytest.approx(1.0, abs=1e-3)
    # PPO accepts it as --reward-model
    run_script(
        "ppo_llm.py",
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--reward-model",
        rm_dir,
        "--reward",
        "model:1.0",
        "--output-dir",
        tmp_path / "ppo",
        "--total-steps",
        1,
        "--batch-size",
        2,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        1,
        "--max-new-tokens",
        4,
        "--eval-every",
        0,
    )
    assert "reward/model" in read_metrics(only_run(tmp_path / "ppo"))[-1]


@pytest.mark.e2e
def test_rm_resume_gives_identical_metrics(tiny, toy_pairs, tmp_path):
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
        "--warmup-steps",
        0,
        "--lr-scheduler",
        "constant",
        "--eval-every",
        2,
        "--num-norm-samples",
        8,
    ]
    run_script("rm_llm.py", *flags(tmp_path / "a", 4))
    run_script("rm_llm.py", *flags(tmp_path / "b", 2))
    first = only_run(tmp_path / "b")
    run_script("rm_llm.py", *flags(tmp_path / "c", 4), "--resume", first)
    strip = lambda rs: [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rs if "rm/norm_gain" not in r
    ]
    straight = strip(read_metrics(only_run(tmp_path / "a")))
    assert straight[-1]["rm/margin"] != 0
    assert straight == strip(read_metrics(first))
