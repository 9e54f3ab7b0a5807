"""algos/grpo_llm.py: every variant's advantage and loss aggregation by hand; end to end; learning; resume."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))
import grpo_llm as G  # noqa: E402

TOY_REWARD = f"{REPO}/tests/toy_reward.py:compute_score"


def test_advantages_variants_by_hand():
    s = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 3.0])
    # group-mean / group std (unbiased): group 1 mean .25 std .5; group 2 mean 2, std 2/sqrt(3)
    a = G.compute_advantages(s, 4, "group-mean", "group")
    want = [1.5, -0.5, -0.5, -0.5] + [x / (2 / 3**0.5) for x in (1.0, -1.0, -1.0, 1.0)]
    assert a.tolist() == pytest.approx(want, abs=1e-4)
    assert G.compute_advantages(s, 4, "group-mean", "none").tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25, 1, -1, -1, 1]
    )
    batch_std = torch.tensor(s.tolist()).std().item()
    assert G.compute_advantages(s, 4, "group-mean", "batch").tolist() == pytest.approx(
        [x / batch_std for x in (0.75, -0.25, -0.25, -0.25, 1, -1, -1, 1)], abs=1e-5
    )
    # rloo: score - mean of the other three
    assert G.compute_advantages(s, 4, "rloo", "none").tolist() == pytest.approx(
        [1, -1 / 3, -1 / 3, -1 / 3, 3 - 5 / 3, 1 - 7 / 3, 1 - 7 / 3, 3 - 5 / 3], abs=1e-5
    )
    assert G.compute_advantages(torch.ones(4), 4, "rloo", "group").eq(0).all()
    equal = G.compute_advantages(torch.tensor([2.0, 2, 2, 2]), 4, "group-mean", "group")
    assert equal.eq(0).all() and not torch.isnan(equal).any()  # identical rewards: zeros, not NaN


def test_loss_aggregation_two_responses_of_different_length():
    # response 1: 1 token with loss 4; response 2: 3 tokens with loss 1 each (T = 3)
    loss = torch.tensor([[4.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    n_tok, n_seq = mask.sum(), 2
    assert G.aggregate(loss, mask, "token-mean", n_tok, n_seq, 8).item() == pytest.approx((4 + 3) / 4)  # 1.75
    assert G.aggregate(loss, mask, "seq-mean-token-mean", n_tok, n_seq, 8).item() == pytest.approx(
        (4 / 1 + 3 / 3) / 2
    )  # 2.5
    assert G.aggregate(loss, mask, "seq-mean-token-sum-norm", n_tok, n_seq, 8).item() == pytest.approx(
        (4 + 3) / (2 * 8)
    )
    # micro-batch shares add up to the minibatch value
    parts = sum(G.aggregate(loss[i : i + 1], mask[i : i + 1], "seq-mean-token-mean", n_tok, n_seq, 8) for i in range(2))
    assert parts.item() == pytest.approx(2.5)


def test_clip_higher_and_overlong_penalty():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    loss, clipped = G.clipped_surrogate(new, old, torch.ones(1, 1), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, -1.1])  # A > 0: ratio capped at 1 + eps_high
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    loss, _ = G.clipped_surrogate(new, old, -torch.ones(1, 1), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([1.5, 0.8, 1.1])  # A < 0: ratio floored at 1 - eps_low
    pen = G.overlong_penalty(torch.tensor([10, 12, 14, 16]), 16, 4, 1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert G.overlong_penalty(torch.tensor([16]), 16, 0, 1.0).tolist() == [0.0]


def test_take_informative_groups_fills_fixed_size():
    def part(scores, width):
        n = len(scores)
        return {
            "rows": list(range(n)),
            "scores": torch.tensor(scores),
            "queries": torch.ones(n, width, dtype=torch.long),
            "query_mask": torch.ones(n, width),
            "responses": torch.ones(n, width + 1, dtype=torch.long),
            "mask": torch.ones(n, width + 1),
            "truncated": torch.zeros(n, dtype=torch.bool),
        }

    a = part([1.0, 1.0, 1.0, 1.0], 2)  # both groups equal
    b = part([0.0, 2.0, 2.0, 2.0], 3)  # group 0 informative
    out, filled = G.take_informative_groups([a, b], 2, 2, pad_id=0)
    assert filled == 1 and out["scores"].tolist() == [0.0, 2.0, 1.0, 1.0]
    assert out["queries"].shape == (4, 3) and out["query_mask"][2:, 0].eq(0).all()  # left-padded
    assert out["responses"].shape == (4, 4) and out["mask"][2:, -1].eq(0).all()  # right-padded


def _tiny_flags(model, prompts, out, *extra):
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
        "--num-prompts",
        2,
        "--group-size",
        4,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        2,
        "--max-new-tokens",
        6,
        "--num-eval-prompts",
        4,
        *extra,
    ]


@pytest.mark.e2e
def test_two_iterations_end_to_end(tiny_peaky, toy_prompts, tmp_path):
    run_script(
        "grpo_llm.py",
        *_tiny_flags(
            tiny_peaky,
            toy_prompts,
            tmp_path,
            "--total-steps",
            2,
            "--eval-every",
            1,
            "--kl-coef",
            0.05,
            "--update-epochs",
            2,
            "--learning-rate",
            1e-3,
        ),
        env={"TOY_MODEL": tiny_peaky},
    )
    run = only_run(tmp_path)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in (
        "train/reward",
        "train/zero_std_groups",
        "train/solve_all",
        "train/solve_none",
        "train/kl",
        "train/entropy",
        "train/clip_frac",
        "loss/policy",
        "eval/accuracy",
        "perf/tokens_per_s",
    ):
        assert key in rows[-1], key
    assert rows[-1]["train/kl"] > 0
    base = load_file(Path(tiny_peaky) / "model.safetensors")
    pol = load_file(run / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    assert any(not torch.equal(base[k], pol[k]) for k in base)


@pytest.mark.e2e
def test_dapo_and_dr_grpo_flags_run(tiny, tmp_path):
    """Built-in task (rewards mostly 0 for a random model): dynamic sampling must resample and fill."""
    run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--output-dir",
        tmp_path / "dapo",
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
        4,
        "--dynamic-sampling",
        "--max-resample-rounds",
        2,
        "--clip-eps-high",
        0.28,
        "--loss-agg",
        "token-mean",
        "--overlong-buffer",
        2,
        "--mask-truncated",
        "--eval-every",
        0,
        "--lora-r",
        4,
        "--gradient-checkpointing",
    )
    row = read_metrics(only_run(tmp_path / "dapo"))[-1]
    assert row["train/resample_rounds"] == 2 and row["train/filled_zero_std_groups"] == 2
    run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny,
        "--output-dir",
        tmp_path / "dr",
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
        4,
        "--scale-rewards",
        "none",
        "--loss-agg",
        "seq-mean-token-sum-norm",
        "--baseline",
        "rloo",
        "--eval-every",
        0,
    )
    assert read_metrics(only_run(tmp_path / "dr"))[-1]["step"] == 1


@pytest.mark.e2e
@pytest.mark.parametrize(
    "fast", [[], ["--mixed-precision", "bf16", "--micro-batch-tokens", 40]], ids=["fp32", "bf16-packed"]
)
def test_learns_toy_task(tiny_peaky, toy_prompts, tmp_path, fast):
    run_script(
        "grpo_llm.py",
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        tmp_path,
        "--total-steps",
        15,
        "--num-prompts",
        8,
        "--group-size",
        4,
        "--mini-batch-size",
        16,
        "--micro-batch-size",
        16,
        "--max-new-tokens",
        6,
        "--learning-rate",
        3e-3,
        "--update-epochs",
        2,
        "--eval-every",
        0,
        *fast,
        env={"TOY_MODEL": tiny_peaky},
    )
    rows = read_metrics(only_run(tmp_path))
    rewards = [r["train/reward"] for r in rows]
    assert all(0 < r["perf/mfu"] and 0 <= r["perf/padding_frac"] < 1 for r in rows)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


@pytest.mark.e2e
def test_resume_gives_identical_metrics(tiny_peaky, toy_prompts, tmp_path):
    flags = lambda out, n: _tiny_flags(
        tiny_peaky, toy_prompts, out, "--total-steps", n, "--eval-every", 2, "--learning-rate", 3e-3, "--kl-coef", 0.05
    )
    env = {"TOY_MODEL": tiny_peaky}
    run_script("grpo_llm.py", *flags(tmp_path / "a", 4), env=env)
    run_script("grpo_llm.py", *flags(tmp_path / "b", 2), env=env)
    first = only_run(tmp_path / "b")
    run_script("grpo_llm.py", *flags(tmp_path / "c", 4), "--resume", first, env=env)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    straight = strip(read_metrics(only_run(tmp_path / "a")))
    resumed = strip(read_metrics(first))
    assert straight[-1]["train/kl"] > 0 and straight == resumed
