"""algos/dpo_llm.py: losses by hand, offline and online end to end, learning a toy preference, resume;
tools.gen_preferences."""

import math
import subprocess
import sys

import pandas as pd
import pytest
import torch

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))
import dpo_llm as D  # noqa: E402

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def test_losses_when_policy_equals_reference():
    x = torch.tensor([-3.0, -7.5])
    for beta in (0.1, 0.5):
        assert D.dpo_loss(x, x - 1, x, x - 1, "sigmoid", beta).tolist() == pytest.approx([0.693147] * 2, abs=1e-6)
        assert D.dpo_loss(x, x, x, x, "sigmoid", beta, 0.2).tolist() == pytest.approx([0.693147] * 2, abs=1e-6)
        assert D.dpo_loss(x, x, x, x, "ipo", beta).tolist() == pytest.approx([(1 / (2 * beta)) ** 2] * 2)
        assert D.dpo_loss(x, x, x, x, "hinge", beta).tolist() == pytest.approx([1.0, 1.0])


def test_losses_at_chosen_values():
    # z = (pi_c - ref_c) - (pi_r - ref_r) = (-1 - -2) - (-4 - -3) = 2
    pc, pr, rc, rr = map(torch.tensor, ([-1.0], [-4.0], [-2.0], [-3.0]))
    beta, eps = 0.5, 0.1
    sig = lambda v: 1 / (1 + math.exp(-v))
    assert D.dpo_loss(pc, pr, rc, rr, "sigmoid", beta).item() == pytest.approx(-math.log(sig(1.0)))
    assert D.dpo_loss(pc, pr, rc, rr, "sigmoid", beta, eps).item() == pytest.approx(
        -(1 - eps) * math.log(sig(1.0)) - eps * math.log(sig(-1.0))
    )
    assert D.dpo_loss(pc, pr, rc, rr, "ipo", beta).item() == pytest.approx((2 - 1) ** 2)
    assert D.dpo_loss(pc, pr, rc, rr, "hinge", beta).item() == pytest.approx(0.0)  # 1 - 0.5*2 = 0
    assert D.dpo_loss(pc, pr, rc, rr, "hinge", 0.25).item() == pytest.approx(0.5)
    assert D.dpo_loss(pc, pr, rc, rr, "robust", beta, eps).item() == pytest.approx(
        (-(1 - eps) * math.log(sig(1.0)) + eps * math.log(sig(-1.0))) / (1 - 2 * eps)
    )


def test_encode_pairs_masks_completions(tiny):
    from common.core.chat import load_tokenizer

    tok = load_tokenizer(tiny)
    ids, attn, comp = D.encode_pairs(
        tok, [{"prompt": "Q: hi", "chosen": " yes", "rejected": " no no no"}], 64, 64, "cpu"
    )
    assert ids.shape[0] == 2 and comp.shape == ids.shape
    n_prompt = len(tok("Q: hi", add_special_tokens=False)["input_ids"])
    assert comp[:, :n_prompt].sum() == 0  # prompt tokens never scored
    assert comp[0].sum() == len(tok(" yes", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    last = int(attn[1].sum()) - 1
    assert ids[1, last] == tok.eos_token_id and comp[1, last] == 1


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
