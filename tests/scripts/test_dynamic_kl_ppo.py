"""algos/dynamic_kl_ppo.py: the beta rule, end to end, exact resume (beta included), and the diff stays small."""

import sys

import pytest
import torch

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def _flags(model, prompts, out, steps, *extra):
    return [
        "--model-name-or-path",
        model,
        "--train-files",
        prompts,
        "--val-files",
        prompts,
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        out,
        "--total-steps",
        steps,
        "--batch-size",
        4,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        1,
        "--max-new-tokens",
        6,
        "--num-eval-prompts",
        4,
        "--eval-every",
        2,
        "--learning-rate",
        3e-3,
        *extra,
    ]


@pytest.mark.e2e
def test_end_to_end_logs_beta_and_resumes_exactly(tiny_peaky, toy_prompts, tmp_path):
    env = {"TOY_MODEL": tiny_peaky}
    run_script("dynamic_kl_ppo.py", *_flags(tiny_peaky, toy_prompts, tmp_path / "a", 4), env=env)
    run_script("dynamic_kl_ppo.py", *_flags(tiny_peaky, toy_prompts, tmp_path / "b", 2), env=env)
    first = only_run(tmp_path / "b")
    state = torch.load(first / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True)
    beta_at_2 = read_metrics(first)[-1]["train/beta"]
    run_script("dynamic_kl_ppo.py", *_flags(tiny_peaky, toy_prompts, tmp_path / "c", 4), "--resume", first, env=env)
    straight = read_metrics(only_run(tmp_path / "a"))
    assert only_run(tmp_path / "a").name.startswith("dynamic_kl_ppo__")
    assert all("train/beta" in r and "train/policy_kl" in r for r in straight[1:])
    betas = [r["train/beta"] for r in straight[1:]]
    assert betas[0] != 0.5 and all(0.01 <= b <= 1.0 for b in betas)  # beta moved, within bounds
    assert state["beta"]["value"] == beta_at_2  # beta is in the checkpoint
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    assert strip(straight) == strip(read_metrics(first))
