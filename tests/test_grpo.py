"""algos/grpo_llm.py: every variant's advantage and loss aggregation by hand; end to end; learning; resume."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, only_run, read_metrics, run_script

sys.path.insert(0, str(REPO / "algos"))
import grpo_llm as G  # noqa: E402

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


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
    loss, stats = G.grpo_loss(new, old, torch.ones(1, 1), torch.ones(1, 3), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, -1.1])  # A > 0: ratio capped at 1 + eps_high
    assert stats["clip_frac"].tolist() == [[1.0, 0.0, 0.0]]
    loss, _ = G.grpo_loss(new, old, -torch.ones(1, 1), torch.ones(1, 3), 0.2, 0.28)
    assert loss.tolist()[0] == pytest.approx([1.5, 0.8, 1.1])  # A < 0: ratio floored at 1 - eps_low
    pen = G.overlong_penalty(torch.tensor([10, 12, 14, 16]), 16, 4, 1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert G.overlong_penalty(torch.tensor([16]), 16, 0, 1.0).tolist() == [0.0]


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
    (tmp_path / "second.py").write_text(
        "def brevity(data_source, solution_str, ground_truth, extra_info=None):\n    return -len(solution_str) / 100\n"
    )
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
            "--reward-fn",
            f"{tmp_path}/second.py:brevity",
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
    # two --reward-fn functions: each logged as reward/<fn>, as PPO does (issue 38: GRPO did not)
    assert "reward/compute_score" in rows[-1] and rows[-1]["reward/brevity"] < 0
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
    "fast",
    [["--mixed-precision", "no", "--micro-batch-tokens", 40]],
    ids=["packed"],  # float32: bf16 on a CPU without bf16 matmul (AVX2) took 206 s of CI here; bf16 GRPO learns in
    # test_vllm_engine.py and bf16 weights in test_correctness.py
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


# --------------------------------------------------------------------------- the 2026 loss family (issue 34)
# hand-made log-probs: row 0 near-on-policy, row 1 a zero-advantage group member, row 2 extreme ratios,
# row 3 fully masked; advantages (b, 1); every formula below is recomputed in numpy, float64
LP = torch.tensor(
    [[-1.0, -2.0, -0.5], [-0.3, -0.2, -1.5], [-0.1, -90.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64
)
OLD = torch.tensor(
    [[-1.1, -1.9, -0.5], [-0.3, -0.4, -1.0], [-80.0, -0.1, -3.0], [-2.0, -0.5, -1.0]], dtype=torch.float64
)
ADV = torch.tensor([[1.5], [0.0], [-0.7], [2.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)


def _grad(fn):
    """(per-token loss, clipped, d sum(loss * mask) / d logprobs) of a loss function of logprobs."""
    lp = LP.clone().requires_grad_(True)
    loss, stats = fn(lp)[:2]
    (loss * MASK).sum().backward()
    return loss.detach().numpy(), stats["clip_frac"].numpy(), lp.grad.numpy()


def test_gspo_value_and_gradient_against_numpy():
    import numpy as np

    lo, hi = 3e-4, 4e-4
    loss, clipped, grad = _grad(lambda lp: G.gspo_loss(lp, OLD, ADV, MASK, lo, hi))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy()[:, 0], MASK.numpy()
    for i in range(4):
        n = m[i].sum()
        s = np.exp(np.clip(((lp[i] - old[i]) * m[i]).sum() / max(n, 1), -20, 20))
        unclipped, bounded = -a[i] * s, -a[i] * np.clip(s, 1 - lo, 1 + hi)
        want = max(unclipped, bounded)
        assert loss[i] == pytest.approx(np.full(3, want)), i  # the sequence's loss on each of its tokens
        assert clipped[i].tolist() == [float(bounded > unclipped)] * 3
        # d/d lp_it of n_i * L_i: the unclipped branch's -A s m_it (the clipped branch is constant)
        want_grad = -a[i] * s * m[i] if unclipped >= bounded and n else np.zeros(3)
        assert grad[i] == pytest.approx(want_grad, abs=1e-12), i
    assert np.isfinite(loss).all() and np.isfinite(grad).all()
    assert grad[1].tolist() == [0, 0, 0] and grad[3].tolist() == [0, 0, 0]  # zero advantage; fully masked row


def test_cispo_value_and_gradient_against_numpy():
    import numpy as np

    eps = 4.0
    loss, clipped, grad = _grad(lambda lp: G.cispo_loss(lp, OLD, ADV, MASK, eps))
    lp, old, a = LP.numpy(), OLD.numpy(), ADV.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    w = np.minimum(r, 1 + eps)  # the capped weight, a constant for the gradient
    assert loss == pytest.approx(-w * a * lp)
    assert grad == pytest.approx(-w * a * MASK.numpy())  # REINFORCE weighted: no token's gradient dropped
    assert clipped.tolist() == (r > 1 + eps).astype(float).tolist()
    assert clipped[2, 0] == 1 and grad[2, 0] == pytest.approx(-(1 + eps) * -0.7)  # a huge ratio: capped, kept
    assert np.isfinite(loss).all() and np.isfinite(grad).all() and (grad[1] == 0).all()


def test_sapo_value_and_gradient_against_numpy():
    import numpy as np

    tau_pos, tau_neg = 1.0, 1.05
    loss, clipped, grad = _grad(lambda lp: G.sapo_loss(lp, OLD, ADV, MASK, tau_pos, tau_neg))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy(), MASK.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    tau = np.where(a > 0, tau_pos, tau_neg)
    g = 1 / (1 + np.exp(-tau * (r - 1)))
    assert loss == pytest.approx(-a * 4 / tau * g)
    live = np.abs(lp - old) <= 20  # beyond, the log-ratio is clamped (finite ratios, as verl): no gradient
    assert grad == pytest.approx(-a * 4 * g * (1 - g) * r * m * live, abs=1e-8)  # d/d lp = d/d r * r
    assert clipped.tolist() == (4 * g * (1 - g) < 0.5).astype(float).tolist()
    # on-policy the soft gate is the policy gradient: weight 1 at r = 1
    same = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    G.sapo_loss(same, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), None, 1.0, 1.05)[
        0
    ].sum().backward()
    assert same.grad.item() == pytest.approx(-1.0)
    assert np.isfinite(loss).all() and np.isfinite(grad).all() and (grad[1] == 0).all()


def test_grpo_loss_gradient_against_numpy():
    import numpy as np

    loss, clipped, grad = _grad(lambda lp: G.grpo_loss(lp, OLD, ADV, MASK, 0.2, 0.28))
    lp, old, a, m = LP.numpy(), OLD.numpy(), ADV.numpy(), MASK.numpy()
    r = np.exp(np.clip(lp - old, -20, 20))
    unclipped, bounded = -a * r, -a * np.clip(r, 0.8, 1.28)
    assert loss == pytest.approx(np.maximum(unclipped, bounded))
    live = np.abs(lp - old) <= 20  # beyond, the log-ratio is clamped (finite ratios, as verl): no gradient
    assert grad == pytest.approx(np.where(unclipped >= bounded, -a * r, 0) * m * live, abs=1e-12)
    assert np.isfinite(grad).all()


# each new loss with one of the sequence-level mismatch corrections (token level: the GSPO and vLLM tests)
NEW_LOSS_TIS = {"gspo": ["sequence", "mask"], "cispo": ["geometric", "reject"], "sapo": ["sequence", "truncate"]}


@pytest.mark.e2e
@pytest.mark.parametrize("loss_type", ["gspo", "cispo", "sapo"])
def test_each_new_loss_learns_the_toy_task(loss_type, tiny_peaky, toy_prompts, tmp_path):
    """15 iterations (CISPO 25) on the toy task (mu = 2, so the second pass is off-policy and each loss's bound acts), with a
    sequence-level --tis-level / --tis-mode (the sampler's log-probs against pi_old): the reward rises by more
    than 0.1, as GRPO's does (test_learns_toy_task), and the correction's metrics are logged."""
    # CISPO climbs the toy slower (one torch thread: +0.054 after 15 steps, +0.127 after 25)
    steps = 25 if loss_type == "cispo" else 15
    flags = ["--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD]
    flags += ["--output-dir", tmp_path, "--total-steps", steps, "--num-prompts", 8, "--group-size", 4]
    flags += ["--mini-batch-size", 16, "--micro-batch-size", 16, "--max-new-tokens", 6, "--learning-rate", 3e-3]
    level, mode = NEW_LOSS_TIS[loss_type]
    flags += ["--tis-cap", 3, "--tis-level", level, "--tis-mode", mode]
    run_script("grpo_llm.py", *flags, "--update-epochs", 2, "--eval-every", 0, "--loss-type", loss_type,
               env={"TOY_MODEL": tiny_peaky})  # fmt: skip
    rows = read_metrics(only_run(tmp_path))
    rewards = [r["train/reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(0 <= r["train/clip_frac"] <= 1 for r in rows)
    assert all(0 <= r["mismatch/capped_frac"] <= 1 for r in rows)
    if loss_type == "gspo":
        assert all(r["train/seq_ratio_min"] <= r["train/seq_ratio_mean"] <= r["train/seq_ratio_max"] for r in rows)


@pytest.mark.e2e
def test_gspo_composes_with_kl_dynamic_sampling_tis_and_resumes(tiny_peaky, toy_prompts, tmp_path):
    """GSPO with the KL term, dynamic sampling, overlong shaping, --tis-cap and token-mean: 3 steps straight
    equal its step-1 checkpoint resumed for steps 2-3 (in a copy of the run folder)."""
    import shutil

    extra = ["--loss-type", "gspo", "--kl-coef", 0.05, "--dynamic-sampling", "--overlong-buffer", 2, "--tis-cap", 2]
    extra += ["--loss-agg", "token-mean", "--update-epochs", 2, "--mini-batch-size", 4, "--learning-rate", 3e-3]
    extra += ["--gspo-eps", 0.01, 0.02, "--total-steps", 3, "--eval-every", 3]
    env = {"TOY_MODEL": tiny_peaky}
    run_script("grpo_llm.py", *_tiny_flags(tiny_peaky, toy_prompts, tmp_path / "a", *extra), "--save-every", 1, env=env)
    straight = only_run(tmp_path / "a")
    copy = tmp_path / "b" / straight.name
    shutil.copytree(straight, copy)
    run_script("grpo_llm.py", *_tiny_flags(tiny_peaky, toy_prompts, tmp_path / "b", *extra), "--resume",
               copy / "checkpoints" / "step_1", env=env)  # fmt: skip
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    a, b = strip(read_metrics(straight)), strip(read_metrics(copy))
    assert a == b and [r["step"] for r in a] == [0, 1, 2, 3]
    assert all("train/seq_ratio_mean" in r for r in a[1:]) and a[-1]["train/kl"] > 0
