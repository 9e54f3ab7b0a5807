"""What the numbers mean: each test here failed on the code before the correctness pass (issue 15).

Reward models scored as trained; the model's own generation_config kept out of rollouts; pi_old
and the sampler gap; temperature after the float32 cast; dynamic-KL beta after the update; clamps;
online DPO on generated ids; no dropout; real lengths in gen_preferences; splits by problem.
"""

import json
import sys

import dynamic_kl_ppo as DKL  # noqa: E402
import pandas as pd
import pytest
import rm_llm as RM  # noqa: E402
import torch

from common.core import chat
from common.core import models as M  # noqa: E402
from common.core.data import PromptRow, load_preferences  # noqa: E402
from common.core.rewards import Reward  # noqa: E402
from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


# ---------------------------------------------------------------------------------------------
# 1. reward models: scored exactly as trained
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("system_prompt", [None, "You grade answers strictly."])
def test_trained_rm_scores_identically_in_rl_and_in_rm_eval(tiny, tmp_path, system_prompt):
    """Through rm_llm's evaluation and through the RL scripts' scorer (common.integrations.inputs.reward_from_args): the
    same scores. With --system-prompt (issue 32.6): the prompt format is saved with the reward model and the RL side
    renders prompts with it (before: the RM tokenizer's defaults, no system prompt)."""
    from accelerate import Accelerator

    from common.harness.args import ModelArgs, RewardArgs
    from common.integrations.inputs import reward_from_args

    rows = [{"prompt": f"Question {i}?", "chosen": "yes indeed", "rejected": "no way"} for i in range(16)]
    pd.DataFrame(rows).to_parquet(tmp_path / "pairs.parquet")
    run_script(
        "rm_llm.py",
        *(["--system-prompt", system_prompt] if system_prompt else []),
        "--model-name-or-path",
        tiny,
        "--train-files",
        tmp_path / "pairs.parquet",
        "--val-files",
        tmp_path / "pairs.parquet",
        "--output-dir",
        tmp_path / "rm",
        "--total-steps",
        3,
        "--batch-size",
        4,
        "--micro-batch-size",
        2,
        "--learning-rate",
        1e-3,
        "--warmup-steps",
        0,
        "--eval-every",
        0,
        "--num-norm-samples",
        8,
    )
    rm_dir = only_run(tmp_path / "rm") / "reward_model"
    cfg = json.loads((rm_dir / "config.json").read_text())
    assert cfg["reward_max_length"] == 512
    tok = chat.load_tokenizer(str(rm_dir))  # saved next to the model: the RL scripts load the RM's own
    chat.set_prompt_format(tok, system_prompt=system_prompt)  # as rm_llm's flags rendered its prompts
    rm = M.load_reward_model(str(rm_dir), tok).eval()
    pairs = load_preferences([str(tmp_path / "pairs.parquet")], tok)[:4]
    with torch.no_grad():  # rm_llm's eval path (raw scores), normalised as the loader does
        c, r = RM.scores_of(rm, tok, pairs, 512, "cpu")
    expected = torch.cat([c, r]) * cfg["reward_gain"] + cfg["reward_bias"]
    # the RL path: PromptRow from the same messages, decoded responses without special tokens, is_eos set
    prow = [
        PromptRow(p["prompt"], "x", None, {}, i, [{"role": "user", "content": f"Question {i}?"}])
        for i, p in enumerate(pairs)
    ]
    rl = reward_from_args(
        RewardArgs(reward="model:1.0", reward_model=str(rm_dir)), ModelArgs(), 48, Accelerator(cpu=True)
    )
    responses = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    scores, _, _ = rl(prow * 2, responses, torch.ones(8), is_eos=[True] * 8)
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)
    if system_prompt:  # the RM tokenizer's defaults (what RL used before) score other text
        plain, _, _ = Reward("model:1.0", reward_model=rm, reward_tok=chat.load_tokenizer(str(rm_dir)))(
            prow * 2, responses, torch.ones(8), is_eos=[True] * 8
        )
        assert (plain - expected).abs().max() > 1e-3
    # before: no EOS, so the head was read at the last content token, a position it never learned
    no_eos, _, _ = Reward("model:1.0", reward_model=rm, reward_tok=tok)(
        prow * 2, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], torch.ones(8)
    )
    assert (no_eos - expected).abs().max() > 1e-3


@pytest.mark.e2e
def test_grpo_pi_old_source_and_sampler_gap(tiny, toy_prompts, tmp_path):
    common = [
        "--model-name-or-path",
        tiny,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--total-steps",
        1,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        6,
        "--eval-every",
        0,
    ]
    env = {"TOY_MODEL": tiny}
    run_script("grpo_llm.py", *common, "--output-dir", tmp_path / "fp32", env=env)
    run = only_run(tmp_path / "fp32")
    # one optimizer step per batch: pi_old is the update forward's own log-probs, whatever the precision
    assert json.loads((run / "args.json").read_text())["old_logprobs_from"] == "current"
    assert read_metrics(run)[-1]["train/sampler_logprob_diff"] < 1e-4  # fp32: the sampler's equal it, measured
    run_script("grpo_llm.py", *common, "--dtype", "bfloat16", "--output-dir", tmp_path / "bf16", env=env)
    run = only_run(tmp_path / "bf16")
    # one optimizer step per batch: pi_old is the update forward's own log-probs (no extra forward)
    assert json.loads((run / "args.json").read_text())["old_logprobs_from"] == "current"
    assert read_metrics(run)[-1]["train/sampler_logprob_diff"] > 0  # bf16 decoding differs from the batched forward
    two_steps = ["--dtype", "bfloat16", "--mini-batch-size", "2", "--micro-batch-size", "1"]
    run_script("grpo_llm.py", *common, *two_steps, "--output-dir", tmp_path / "bf16_2", env=env)
    run = only_run(tmp_path / "bf16_2")
    assert json.loads((run / "args.json").read_text())["old_logprobs_from"] == "trainer"  # 2 steps: recomputed
    assert read_metrics(run)[-1]["train/sampler_logprob_diff"] > 0
    run_script("grpo_llm.py", *common, "--tis-cap", "2.0", "--output-dir", tmp_path / "tis", env=env)
    assert json.loads((only_run(tmp_path / "tis") / "args.json").read_text())["old_logprobs_from"] == "trainer"


@pytest.mark.e2e
def test_dynamic_kl_beta_follows_the_kl_after_the_update(tiny_peaky, toy_prompts, tmp_path):
    run_script(
        "dynamic_kl_ppo.py",
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        tmp_path,
        "--total-steps",
        3,
        "--batch-size",
        4,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        6,
        "--eval-every",
        0,
        "--learning-rate",
        1e-3,
        "--policy-kl-target",
        0.01,
        env={"TOY_MODEL": tiny_peaky},
    )
    rows = read_metrics(only_run(tmp_path))
    beta = 0.5
    for r in rows:
        assert r["train/policy_kl_after"] > 0  # measured after the step: nonzero
        beta = DKL.update_beta(beta, r["train/policy_kl_after"], 0.01, 0.01, 1.0)
        assert r["train/beta"] == pytest.approx(beta)


@pytest.mark.e2e
def test_kl_target_zero_is_refused(tiny, tmp_path):
    for script in ("ppo_llm.py", "dynamic_kl_ppo.py"):
        proc = run_script(script, "--model-name-or-path", tiny, "--kl-target", 0, "--output-dir", tmp_path, check=False)
        assert proc.returncode != 0 and "--kl-target 0" in proc.stderr


# ---------------------------------------------------------------------------------------------
# 7. held out means held out
# ---------------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_builtin_splits_share_no_problem(tiny, tmp_path):
    import subprocess

    from common.core.data import overlap_report, problem_key, read_table
    from common.core.tasks import reasoning_gym_rows

    assert problem_key("What is 3 + 5 =") == problem_key("What is 5 + 3 =") != problem_key("What is 3 + 6 =")
    out = tmp_path / "data"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.prepare_data",
            "--out",
            str(out),
            "--tasks",
            "chain_sum_1d",
            "leg_counting",
            "--train-size",
            "300",
            "--test-size",
            "40",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    for task in ("chain_sum_1d", "leg_counting"):
        train, test = read_table(str(out / task / "train.parquet")), read_table(str(out / task / "test.parquet"))
        rep = overlap_report(train, test)
        assert (
            rep["test_rows"] > 20
            and rep["test_rows_with_problem_in_train"] == 0
            and rep["test_rows_with_prompt_in_train"] == 0
        )
        pairs = read_table(str(out / task / "pairs_test.parquet"))  # derived files inherit the split
        assert overlap_report(train, pairs)["test_rows_with_problem_in_train"] == 0
    # the old split (two seeds over the same space) shares every chain_sum_1d test question; inspect_data says so
    from common.core.data import write_rows

    write_rows(reasoning_gym_rows("chain_sum_1d", 2000, 0, "train"), tmp_path / "old_train.parquet")
    write_rows(reasoning_gym_rows("chain_sum_1d", 40, 1_000_000, "test"), tmp_path / "old_test.parquet")
    from tools.inspect_data import report

    rep = report([str(tmp_path / "old_test.parquet")], tiny, against=[str(tmp_path / "old_train.parquet")])
    assert rep["overlap_with_train"]["test_rows_with_problem_in_train"] == 40
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.inspect_data",
            str(tmp_path / "old_test.parquet"),
            "--against",
            str(tmp_path / "old_train.parquet"),
            "--model",
            tiny,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "overlap_with_train" in proc.stdout
