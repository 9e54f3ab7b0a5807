"""algos/distill_llm.py: each divergence against numpy over the vocabulary, the sampled-token estimator's
expectation, the tokenizer check, and (e2e) resume identity and a learning test."""

import sys

import numpy as np
import pytest

from conftest import REPO, only_run, read_metrics, run_script
from shared_distill import _flags

sys.path.insert(0, str(REPO / "algos"))


def with_references(toy_prompts, folder):
    """The toy prompts with a reference response each (extra_info.response), for off-policy steps (--lmbda < 1)."""
    import json

    rows = [json.loads(line) for line in open(toy_prompts)]
    for i, r in enumerate(rows):
        r["extra_info"]["response"] = f"yes {i}"
    (folder / "refs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "refs.jsonl")


@pytest.mark.e2e
def test_resume_gives_identical_metrics_with_lmbda(tiny, tiny_peaky, toy_prompts, tmp_path):
    """4 steps straight = 2 steps + --resume + 2, with off-policy steps mixed in (--lmbda 0.5) and the top-k loss."""
    extra = ["--lmbda", 0.5, "--loss", "topk-fkl", "--eval-every", 2, "--learning-rate", 1e-3]
    toy_prompts = with_references(toy_prompts, tmp_path)
    env = {"TOY_MODEL": tiny_peaky}
    run_script(
        "distill_llm.py", *_flags(tiny, tiny_peaky, toy_prompts, tmp_path / "a", "--total-steps", 4, *extra), env=env
    )
    run_script(
        "distill_llm.py", *_flags(tiny, tiny_peaky, toy_prompts, tmp_path / "b", "--total-steps", 2, *extra), env=env
    )
    first = only_run(tmp_path / "b")
    run_script("distill_llm.py", *_flags(tiny, tiny_peaky, toy_prompts, tmp_path / "c", "--total-steps", 4, *extra),
               "--resume", first, env=env)  # fmt: skip
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    a, b = strip(read_metrics(only_run(tmp_path / "a"))), strip(read_metrics(first))
    assert a == b and {r["train/on_policy"] for r in a if r["step"]} == {0.0, 1.0}, a


@pytest.mark.e2e
def test_a_teacher_whose_head_is_padded_past_the_shared_tokenizer(tiny, tiny_peaky, toy_prompts, tmp_path):
    """The same tokenizer, the teacher's head padded by 64 rows (as sizes of one family differ): each loss runs (the
    exact reverse KL on the off-policy steps of reverse-kl-pg too), with the teacher cut to the student's rows."""
    from common.core import chat
    from common.core import models as M

    tok = chat.load_tokenizer(tiny_peaky)
    teacher = M.load_causal_lm(tiny_peaky, tok)
    teacher.resize_token_embeddings(teacher.config.vocab_size + 64)
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    assert chat.vocab_rows(str(tmp_path / "teacher")) == chat.vocab_rows(tiny) + 64
    refs = with_references(toy_prompts, tmp_path)
    for loss in ("gkd", "topk-fkl", "reverse-kl-pg"):
        out = tmp_path / loss
        run_script("distill_llm.py", *_flags(tiny, tmp_path / "teacher", refs, out, "--total-steps", 2, "--loss", loss,
                   "--lmbda", 0.5, "--eval-every", 0), env={"TOY_MODEL": tiny})  # fmt: skip
        rows = read_metrics(only_run(out))
        assert len(rows) == 2 and all(np.isfinite(r["train/kl"]) and r["train/kl"] >= 0 for r in rows), (loss, rows)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "loss,budget",
    [("gkd", ["--total-steps", 20]), ("reverse-kl-pg", ["--total-steps", 30, "--samples-per-prompt", 4])],
    ids=["gkd", "reverse-kl-pg"],
)
def test_the_student_reaches_the_teachers_reward(loss, budget, tiny_peaky, toy_prompts, tmp_path, grpo_toy_teacher):
    """A teacher trained by GRPO on the toy task (conftest.grpo_toy_teacher: its reward well above the base's); the base
    distilled from it on-policy reaches >= 90 % of the teacher's reward gain, and its KL to the teacher halves. The
    sampled-token estimator is noisier: 30 steps of 4 samples per prompt (the exact reverse KL: 20 steps of 2)."""
    env = {"TOY_MODEL": tiny_peaky}
    teacher = grpo_toy_teacher / "checkpoints" / "step_15" / "policy"
    rewards = [r["train/reward"] for r in read_metrics(grpo_toy_teacher)]
    base, taught = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    run_script("distill_llm.py", *_flags(tiny_peaky, teacher, toy_prompts, tmp_path / "s", *budget, "--loss", loss,
               "--learning-rate", 3e-3, "--eval-every", 0), env=env)  # fmt: skip
    rows = read_metrics(only_run(tmp_path / "s"))
    # the student's reward over its last 5 steps (80 samples: over 3, the mean's noise, ~0.06, matched the margin;
    # a CPU whose float32 kernels sum in another order ended a gkd run on 0.71, 0.65 after 0.80, 0.73)
    student = sum(r["train/reward"] for r in rows[-5:]) / 5
    assert taught > base + 0.1, rewards
    assert student - base >= 0.9 * (taught - base), ([r["train/reward"] for r in rows], base, taught)
    assert rows[-1]["train/kl"] < 0.5 * rows[0]["train/kl"], [r["train/kl"] for r in rows]
