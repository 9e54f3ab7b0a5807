"""Rewards as services (issue 37.3): the --reward-url client against servers started here (threads in this
process), tools.serve_rm against the same reward model in process, the LLM judge against a stub OpenAI-compatible
server, retries, a dead service, the fallback, and mixes with rule rewards."""

import pytest

from conftest import REPO, only_run, read_metrics, run_script
from shared_remote_rewards import Stub


@pytest.mark.e2e
def test_grpo_with_a_served_reward_model_mixed_with_rules(tiny_peaky, toy_prompts, tmp_path):
    """grpo_llm.py as a user runs it: --reward 'rule:1.0,remote:0.5' against a service this test runs; the logged
    remote component is the service's score (the response's length here)."""
    stub = Stub(lambda body, n: (200, {"scores": [len(r) / 10 for r in body["responses"]]}))
    try:
        run_script(
            "grpo_llm.py", "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--reward-fn",
            f"{REPO}/tests/helpers/toy_reward.py:compute_score", "--reward", "rule:1.0,remote:0.5", "--reward-url", stub.url,
            "--output-dir", tmp_path, "--total-steps", 2, "--num-prompts", 2, "--group-size", 2, "--mini-batch-size",
            4, "--micro-batch-size", 4, "--max-new-tokens", 6, "--eval-every", 0, env={"TOY_MODEL": tiny_peaky},
        )  # fmt: skip
    finally:
        stub.close()
    rows = read_metrics(only_run(tmp_path))
    assert len(stub.bodies) >= 2 and all(r["reward/remote"] > 0 for r in rows), rows
