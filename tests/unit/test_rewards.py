"""Scorers, the registry, custom functions, weighted mixes, failures."""

import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from common.core.data import PromptRow
from common.core.reward_workers import RewardError
from common.core.rewards import Reward, parse_mix
from common.core.scorers import check_data_sources, compute_score, extract_tag_answer, load_reward_fn
from common.core.tasks import reasoning_gym_rows


def rg_row(task="chain_sum", i=0):
    r = reasoning_gym_rows(task, i + 1, 0, "test")[i]
    return PromptRow("q", r["data_source"], r["reward_model"]["ground_truth"], r["extra_info"], i)


def test_reasoning_gym_scorer_exact_and_partial():
    row = rg_row()
    gt = row.ground_truth
    assert compute_score(row.data_source, f"think... <answer>{gt}</answer>", gt, row.extra_info) == {
        "score": 1.0,
        "acc": 1.0,
    }
    # no tags: the last number counts (small models rarely keep the format); no number: 0
    assert compute_score(row.data_source, f"it is 5, so {gt}.", gt, row.extra_info)["acc"] == 1.0
    assert compute_score(row.data_source, f"{gt} is not it, 99999 is", gt, row.extra_info)["acc"] == 0.0
    assert compute_score(row.data_source, "no idea", gt, row.extra_info)["score"] == 0.0
    assert compute_score(row.data_source, f"<answer>7777</answer> {gt}", gt, row.extra_info)["acc"] == 0.0  # tags win
    wrong = compute_score(row.data_source, f"<answer>{gt}1</answer>", gt, row.extra_info)
    assert wrong["acc"] == 0.0 and wrong["score"] < 1.0  # partial credit never counts as accurate
    lc = rg_row("letter_counting")
    assert compute_score(lc.data_source, "I cannot tell", lc.ground_truth, lc.extra_info)["score"] == 0.0
    cd = rg_row("countdown")
    entry = json.loads(cd.extra_info["entry"])
    assert (
        compute_score(cd.data_source, f"<answer>{entry['answer']}</answer>", cd.ground_truth, cd.extra_info)["acc"]
        == 1.0
    )


def test_gsm8k_modes_and_math():
    from common.core.scorers import gsm8k_score

    assert gsm8k_score("openai/gsm8k", "blah 12 then 7", "7", mode="flexible")["score"] == 1.0
    assert gsm8k_score("openai/gsm8k", "blah 12 then 7", "7", mode="strict")["score"] == 0.0
    assert compute_score("lighteval/MATH", r"<answer>\frac{1}{2}</answer>", "0.5")["score"] == 1.0
    assert compute_score("lighteval/MATH", r"so \boxed{3}", "3")["score"] == 1.0
    assert compute_score("lighteval/MATH", r"<answer>4</answer>", "3")["score"] == 0.0
    assert extract_tag_answer("<answer> 1 </answer> and <answer>2</answer>") == "2"


def test_unknown_data_source_lists_known():
    with pytest.raises(ValueError, match=r"unknown data_source \['nope'\]; known: .*reasoning_gym/"):
        check_data_sources(["reasoning_gym/chain_sum", "nope"])


def test_custom_reward_fn(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def fn(data_source, solution_str, ground_truth, extra_info=None):\n    return len(solution_str) / 10\n"
        "def bad(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n"
    )
    assert load_reward_fn(f"{f}:fn")("x", "abcde", None, {}) == 0.5
    with pytest.raises(ValueError, match="not found"):
        load_reward_fn(f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_reward_fn(f"{f}:nope")
    r = Reward("rule:1.0", reward_fn=f"{f}:fn")
    r.check(["anything"])  # custom functions dispatch themselves: no registry check
    rows = [PromptRow("p", "anything", None, {}, 7)]
    scores, comps, _ = r(rows, ["abcdefghij"], torch.tensor([3]))
    assert scores.tolist() == [1.0]
    bad = Reward("rule:1.0", reward_fn=f"{f}:bad")
    with pytest.raises(RewardError, match=r"data_source 'anything', row 7, response 'xyz'"):
        bad(rows, ["xyz"], torch.tensor([1]))
    fallback = Reward("rule:1.0", reward_fn=f"{f}:bad", fallback=-1.0)
    assert fallback(rows, ["xyz"], torch.tensor([1]))[0].tolist() == [-1.0] and fallback.errors == 1


def test_weighted_mix_logs_components():
    row = rg_row()
    gt = row.ground_truth
    r = Reward("rule:1.0,format:0.5,length:0.1", max_new_tokens=10)
    scores, comps, extras = r([row, row], [f"<answer>{gt}</answer>", "no tags"], torch.tensor([4, 10]))
    assert comps["rule"].tolist() == [1.0, 0.0] and comps["format"].tolist() == [1.0, 0.0]
    assert comps["length"].tolist() == pytest.approx([-0.4, -1.0])
    assert scores.tolist() == pytest.approx([1.0 + 0.5 - 0.04, -0.1])
    assert extras["acc"].tolist() == [1.0, 0.0]
    assert parse_mix("rule:1,model:0.5") == {"rule": 1.0, "model": 0.5}
    with pytest.raises(ValueError, match="unknown source 'foo'"):
        parse_mix("foo:1")
    with pytest.raises(ValueError, match="no --reward-model"):
        Reward("model:1.0")


def test_exact_reward_drops_partial_credit():
    """'exact': 1 only for an exactly right answer. letter_counting's own scorer gives containment credit
    ("1.28" for 1 scores 0.25, "12" 0.5): the credit GRPO farmed on that task (docs/results.md)."""
    lc = rg_row("letter_counting")
    gt = lc.ground_truth
    texts = [f"<answer>{gt}</answer>", f"<answer>{gt}.28</answer>", f"<answer>{gt}2</answer>", "no idea"]
    lens = torch.tensor([4, 4, 4, 2])
    _, rule, extras = Reward("rule:1.0")([lc] * 4, texts, lens)
    scores, comps, _ = Reward("exact:2.0,format:0.5")([lc] * 4, texts, lens)
    assert rule["rule"].tolist() == [1.0, 0.25, 0.5, 0.0]  # reasoning-gym's partial credit
    assert comps["exact"].tolist() == extras["acc"].tolist() == [1.0, 0.0, 0.0, 0.0] and "rule" not in comps
    assert scores.tolist() == pytest.approx([2.5, 0.5, 0.5, 0.0])


def test_reward_model_scores_batched(tiny):
    from common.core.chat import load_tokenizer
    from common.core.models import load_reward_model

    tok = load_tokenizer(tiny)
    rm = load_reward_model(tiny, tok).eval()
    r = Reward("model:2.0", reward_model=rm, reward_tok=tok, batch_size=2)
    rows = [PromptRow(f"prompt {i}", "x", None, {}, i) for i in range(3)]
    scores, comps, _ = r(rows, ["a", "bb", "ccc"], torch.tensor([1, 1, 1]))
    ids = tok("prompt 0", add_special_tokens=False)["input_ids"] + tok("a", add_special_tokens=False)["input_ids"]
    with torch.no_grad():  # prompt and response tokenized apart, as the policy produced them; no EOS (is_eos not given)
        direct = rm(input_ids=torch.tensor([ids])).logits[0, 0]
    assert scores.shape == (3,) and math.isclose(comps["model"][0].item(), direct.item(), abs_tol=1e-5)
    assert torch.allclose(scores, 2 * comps["model"])


def test_several_reward_functions_with_weights_and_length_bonus(tmp_path):
    (tmp_path / "a.py").write_text(
        "def has_yes(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float('yes' in solution_str)\n"
    )
    (tmp_path / "b.py").write_text(
        "def keyword_penalty(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': -float('bad' in solution_str), 'note': 'text fields are fine'}\n"
    )
    r = Reward(
        "rule:1.0,length_bonus:0.5",
        [f"{tmp_path}/a.py:has_yes", f"{tmp_path}/b.py:keyword_penalty"],
        max_new_tokens=10,
        reward_weights=[0.6, 0.4],
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(3)]
    scores, comps, extras = r(rows, ["yes", "yes bad", "no"], torch.tensor([5, 20, 2]))
    assert comps["rule"].tolist() == pytest.approx([0.6, 0.6 - 0.4, 0.0])
    assert comps["length_bonus"].tolist() == pytest.approx([0.5, 1.0, 0.2])  # bounded at 1
    assert extras["has_yes"].tolist() == [1.0, 1.0, 0.0] and extras["keyword_penalty"].tolist() == [0.0, -1.0, 0.0]
    assert scores.tolist() == pytest.approx([0.6 + 0.25, 0.2 + 0.5, 0.1])
    with pytest.raises(ValueError, match="2 weight"):
        Reward("rule:1.0", [f"{tmp_path}/a.py:has_yes"], reward_weights=[0.5, 0.5])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stuck_reward_function_times_out_with_the_row(tmp_path, workers):
    (tmp_path / "slow.py").write_text(
        "import time\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'stuck' in solution_str:\n        time.sleep(30)\n    return 1.0\n"
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(2)]
    r = Reward("rule:1.0", f"{tmp_path}/slow.py:score", timeout=0.3, workers=workers)
    with pytest.raises(RewardError, match=r"row 1.*no result after 0.3 s"):
        r(rows, ["fine", "stuck here"], torch.ones(2))
    r = Reward("rule:1.0", f"{tmp_path}/slow.py:score", timeout=0.3, fallback=-1.0, workers=workers)
    scores, _, _ = r(rows, ["fine", "stuck here"], torch.ones(2))
    assert scores.tolist() == [1.0, -1.0] and r.errors == 1


def test_the_pool_scores_as_the_trainer_does(tmp_path):
    """Several functions with extras and weights: the pool's scores equal in-process scoring; the
    workers are other processes, started once and reused."""
    (tmp_path / "a.py").write_text(
        "import os\ndef has_yes(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float('yes' in solution_str) + len(ground_truth or ''), 'pid': os.getpid()}\n"
    )
    (tmp_path / "b.py").write_text(
        "def pen(data_source, solution_str, ground_truth, extra_info=None):\n    return -0.5 * extra_info.get('w', 1)\n"
    )
    specs = [f"{tmp_path}/a.py:has_yes", f"{tmp_path}/b.py:pen"]
    rows = [PromptRow("p", "x", "ab"[: i % 3], {"w": i}, i) for i in range(7)]
    responses = ["yes", "no", "yes yes", "", "maybe", "yes", "n"]
    results = {w: Reward("rule:1.0", specs, reward_weights=[0.7, 0.3], workers=w) for w in (0, 2)}
    out = {w: r(rows, responses, torch.ones(7)) for w, r in results.items()}
    assert torch.equal(out[0][0], out[2][0]) and torch.equal(out[0][1]["rule"], out[2][1]["rule"])
    assert torch.equal(out[0][2]["pen"], out[2][2]["pen"])
    assert set(out[0][2]["pid"].tolist()) == {os.getpid()} and os.getpid() not in out[2][2]["pid"].tolist()
    workers = set(results[2].pool.pool._processes)  # the pool's two processes
    again = set(results[2](rows, responses, torch.ones(7))[2]["pid"].tolist())
    assert len(workers) == 2 and set(out[2][2]["pid"].tolist()) <= workers and again <= workers
    results[2].pool.close()


def test_a_crashing_or_unresponsive_reward_function_costs_a_row_not_the_run(tmp_path):
    """os._exit in a worker (as a segfault would) and a hang the SIGALRM timer cannot reach (the
    function ignores it) become failures of their row; the pool restarts and scores the next batch."""
    (tmp_path / "bad.py").write_text(
        "import os, signal, time\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'crash':\n        os._exit(3)\n"
        "    if solution_str == 'deaf':\n        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n        time.sleep(60)\n"
        "    return 1.0\n"
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(3)]
    r = Reward("rule:1.0", f"{tmp_path}/bad.py:score", workers=2)
    with pytest.raises(RewardError, match=r"row 1.*worker process died"):
        r(rows, ["ok", "crash", "ok"], torch.ones(3))
    assert r(rows, ["ok", "ok", "ok"], torch.ones(3))[0].tolist() == [1.0, 1.0, 1.0]  # a fresh pool
    r = Reward("rule:1.0", f"{tmp_path}/bad.py:score", workers=2, timeout=0.2, fallback=0.0)
    start = time.monotonic()
    scores, _, _ = r(rows, ["ok", "deaf", "ok"], torch.ones(3))
    assert scores.tolist() == [1.0, 0.0, 1.0] and r.errors == 1 and time.monotonic() - start < 15
    assert r(rows, ["ok", "ok", "ok"], torch.ones(3))[0].tolist() == [1.0, 1.0, 1.0]
    r.pool.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_function_calling_sys_exit_is_that_functions_error(tmp_path, workers):
    """sys.exit(3) inside user code used to end the training run with exit 3 and no message (issue 38): it is
    the function failing on that row (an error naming it, or --reward-fallback)."""
    (tmp_path / "quits.py").write_text(
        "import sys\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if 'quit' in solution_str:\n        sys.exit(3)\n    return 1.0\n"
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(2)]
    r = Reward("rule:1.0", f"{tmp_path}/quits.py:score", timeout=10, workers=workers)
    with pytest.raises(RewardError, match=r"row 1.*SystemExit\(3\)"):
        r(rows, ["fine", "quit now"], torch.ones(2))
    r = Reward("rule:1.0", f"{tmp_path}/quits.py:score", timeout=10, fallback=-1.0, workers=workers)
    scores, _, _ = r(rows, ["fine", "quit now"], torch.ones(2))
    assert scores.tolist() == [1.0, -1.0] and r.errors == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_reward_functions_that_ignore_sigalrm_interrupt_or_return_unpicklable_results(tmp_path, workers):
    """Issue 38: a function that ignores SIGALRM (sleeping, or a busy loop) hung the run forever in-process and
    for ~17 minutes a step in workers; one that raises KeyboardInterrupt, or returns what cannot be pickled back
    from a worker, was a traceback naming no row. Each is now that function's failure on its row, bounded by
    --reward-timeout + 1 s (the watchdog), in both modes."""
    (tmp_path / "rude.py").write_text(
        "import signal, time\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'deaf':\n        signal.signal(signal.SIGALRM, signal.SIG_IGN)\n        time.sleep(60)\n"
        "    if solution_str == 'busy':\n        signal.signal(signal.SIGALRM, lambda *a: None)\n"
        "        while True:\n            pass\n"
        "    if solution_str == 'ctrl-c':\n        raise KeyboardInterrupt\n"
        "    if solution_str == 'lambda':\n        return {'score': 1.0, 'f': lambda: 0}\n"
        "    return 1.0\n"
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(3)]
    r = Reward("rule:1.0", f"{tmp_path}/rude.py:score", timeout=0.3, fallback=-1.0, workers=workers)
    for bad in ("deaf", "busy", "ctrl-c") + (("lambda",) if workers else ()):
        start = time.monotonic()
        scores, _, _ = r(rows, ["ok", bad, "ok"], torch.ones(3))
        assert scores.tolist() == [1.0, -1.0, 1.0], bad
        assert time.monotonic() - start < 8, bad  # timeout 0.3 s + the watchdog's 1 s (+ a pool restart)
    r = Reward("rule:1.0", f"{tmp_path}/rude.py:score", timeout=0.3, workers=workers)
    # the watchdog's message; in a worker on a loaded machine the pool's own deadline (5 s later) may come first
    with pytest.raises(RewardError, match=r"row 1.*(ignores SIGALRM|gave no result within)"):
        r(rows, ["ok", "busy", "ok"], torch.ones(3))
    with pytest.raises(RewardError, match=r"row 1.*KeyboardInterrupt"):
        r(rows, ["ok", "ctrl-c", "ok"], torch.ones(3))
    if workers:
        with pytest.raises(RewardError, match=r"row 1.*cannot be sent back from the reward worker"):
            r(rows, ["ok", "lambda", "ok"], torch.ones(3))
        r.pool.close()


def test_a_leaking_reward_function_gets_fresh_workers(tmp_path):
    """A worker above --reward-worker-max-gb of resident memory is replaced after the batch (a leak grew workers
    1.0 -> 3.2 GiB in 11 steps, issue 38); the next batch scores on new processes."""
    (tmp_path / "leak.py").write_text(
        "import os\nKEEP = []\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    KEEP.append(bytearray(60 * 2**20))\n    return {'score': 1.0, 'pid': os.getpid()}\n"
    )
    rows = [PromptRow("p", "x", None, {}, i) for i in range(4)]
    r = Reward("rule:1.0", f"{tmp_path}/leak.py:score", workers=2, worker_max_gb=0.15)
    first = set(r(rows, ["a"] * 4, torch.ones(4))[2]["pid"].tolist())
    assert r.pool.recycled == 1 and r.pool.pool is None  # above 0.15 GiB: the workers went
    second = set(r(rows, ["a"] * 4, torch.ones(4))[2]["pid"].tolist())
    assert not first & second
    keep = Reward("rule:1.0", f"{tmp_path}/leak.py:score", workers=2, worker_max_gb=0)  # 0: never
    keep(rows, ["a"] * 4, torch.ones(4))
    assert keep.pool.recycled == 0 and keep.pool.pool is not None
    keep.pool.close()


def test_the_failed_row_is_the_error_not_a_row_skipped_after_it(tmp_path):
    """Groups scored as rows finish (ScoreAsTheyFinish) come back in any order: the pool marks the rows after a
    failure in its group "not scored", and the error names the row that failed, even when a skipped row is earlier."""
    from common.core.reward_workers import NOT_SCORED

    (tmp_path / "f.py").write_text("def score(ds, s, gt, extra_info=None):\n    return 1.0\n")
    reward = Reward("rule:1.0", reward_fn=f"{tmp_path}/f.py:score", workers=1)
    rows = [PromptRow(f"q{i}", "anything", "", {}, uid=i) for i in range(3)]
    raw = [[(False, NOT_SCORED)], [(False, "ValueError('bad')")], [(True, 1.0)]]
    with pytest.raises(RewardError, match=r"row 1, .*ValueError\('bad'\)"):
        reward(rows, ["a", "b", "c"], torch.ones(3), parts={"raw": raw})


def test_reward_workers_outlive_the_scoring_thread(tmp_path):
    """Rows scored as they finish (ScoreAsTheyFinish) go to the pool from a thread that ends with each batch. The
    workers were forked there, at the pool's first submit, and PR_SET_PDEATHSIG fires when the *thread* that forked
    a child exits: the workers were killed after every batch, restarted the next, and a worker killed holding the
    task queue's lock left the run hanging at exit (CI, a DDP GRPO test). They start in the trainer's thread now and
    serve every batch."""
    from common.core.rewards import ScoreAsTheyFinish

    (tmp_path / "pid.py").write_text(
        "import os\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'pid': os.getpid()}\n"
    )
    reward = Reward("rule:1.0", reward_fn=f"{tmp_path}/pid.py:score", workers=2)
    rows = [PromptRow(f"q{i}", "x", None, {}, uid=i) for i in range(4)]
    pools = []
    for _ in range(3):  # three batches, each with its own scoring thread
        scoring = ScoreAsTheyFinish(reward, rows, tok=None)
        raw = scoring.parts(["a"] * 4, [True] * 4)["raw"]  # the thread scores all 4 rows, then ends
        assert [ok for outs in raw for ok, _ in outs] == [True] * 4, raw
        time.sleep(0.5)  # a parent-death signal would have landed by now
        pids = sorted(reward.pool.pool._processes)
        assert all(Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text() for p in pids)
        pools.append(pids)
    assert len(pools[0]) == 2 and pools[0] == pools[1] == pools[2], pools
    reward.pool.close()
