"""Training precision (issue 32.1): what a default-configured GPU run trains, and the bf16-safe update.

No GPU here: the GPU default is tested through the same decisions with torch.cuda reporting a bf16 GPU (the
dtypes the loaders and make_accelerator pick for cuda) and the same update arithmetic on CPU (bf16 autocast)."""

import pytest

from conftest import REPO, only_run, read_metrics, run_script


@pytest.mark.e2e
def test_bf16_weights_train_and_resume_exactly(tiny_peaky, toy_prompts, tmp_path):
    """GRPO with --dtype bfloat16 (KahanAdamW): 4 steps straight = 2 steps + --resume + 2, metric for metric."""
    flags = lambda out, n: [
        "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--reward-fn",
        f"{REPO}/tests/helpers/toy_reward.py:compute_score", "--output-dir", out, "--total-steps", n, "--num-prompts", 4,
        "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 4, "--max-new-tokens", 6, "--eval-every", 0,
        "--learning-rate", 3e-3, "--dtype", "bfloat16",
    ]  # fmt: skip
    env = {"TOY_MODEL": tiny_peaky}
    run_script("grpo_llm.py", *flags(tmp_path / "a", 4), env=env)
    run_script("grpo_llm.py", *flags(tmp_path / "b", 2), env=env)
    first = only_run(tmp_path / "b")
    run_script("grpo_llm.py", *flags(tmp_path / "c", 4), "--resume", first, env=env)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    straight, resumed = strip(read_metrics(only_run(tmp_path / "a"))), strip(read_metrics(first))
    assert straight == resumed and [r["step"] for r in straight] == [1, 2, 3, 4]
