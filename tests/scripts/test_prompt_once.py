"""Issue 52's two levers, each against the computation it replaces: the LM head applied in chunks from the hidden
states (common.core.ops.head_logprobs) and a group's prompt run once in the forward and backward
(forward_logprobs(share_prompts=True)): the same values and gradients, on every GRPO loss and aggregation, with
the KL term, multi-turn masks, LoRA, packed micro-batches, and (distributed tier) DDP with 2 processes."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


def levers_off_run(script, flags, out, env=None, launcher=None):
    """`script` with both levers off: --no-share-prompts and the full logits (CLEANRLHF_LM_HEAD=full)."""
    from conftest import run_script

    off_env = {**(env or {}), "CLEANRLHF_LM_HEAD": "full"}
    (launcher or run_script)(script, *flags, "--no-share-prompts", "--output-dir", out, env=off_env)


@pytest.mark.e2e
def test_grpo_with_tools_and_both_levers_makes_the_update_of_neither(tiny_agent, toy_prompts, tmp_path):
    """A multi-turn GRPO step (--env tools, observation tokens in the responses), KL term, two minibatches and two
    epochs, float32: the same losses and the same updated weights with the levers on (the default) and off."""
    from safetensors.torch import load_file

    from conftest import only_run, read_metrics, run_script
    from shared_distributed import assert_same_update

    flags = [
        "--model-name-or-path", tiny_agent, "--train-files", toy_prompts, "--reward-fn", f"{REPO}/tests/helpers/toy_reward.py:compute_score",
        "--env", "tools", "--tools", "calculator", "--max-turns", 3, "--max-new-tokens", 40, "--max-trajectory-tokens", 160,
        "--num-prompts", 4, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 4, "--update-epochs", 2,
        "--kl-coef", 0.05, "--learning-rate", 1e-4, "--eval-every", 0, "--total-steps", 1, "--mixed-precision", "no",
        "--save-every", 1,
    ]  # fmt: skip
    env = {"TOY_MODEL": tiny_agent}
    run_script("grpo_llm.py", *flags, "--output-dir", tmp_path / "on", env=env)
    levers_off_run("grpo_llm.py", flags, tmp_path / "off", env)
    on, off = only_run(tmp_path / "on"), only_run(tmp_path / "off")
    (a,), (b,) = read_metrics(on), read_metrics(off)
    assert a["env/turns"] > 1 and a["env/obs_frac"] > 0  # multi-turn rows, observation tokens masked out
    assert a["train/response_len"] == b["train/response_len"]  # the same samples
    for key in ("loss/policy", "loss/kl", "train/entropy", "train/kl", "train/clip_frac"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    base = load_file(f"{tiny_agent}/model.safetensors")
    assert_same_update(on / "checkpoints/step_1/policy", off / "checkpoints/step_1/policy", base)
