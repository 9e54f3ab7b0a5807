"""GRPO's step helpers (algos/grpo_llm.py, copied into async_grpo.py) around common.core.sampling's Rollout: the prompt
draw and its seeds, DAPO's dynamic sampling, the group reward keys, the reward by data source; the samples table.
Each against a plain computation in the test."""

import sys

import numpy as np
import pytest
import torch

from common.core.data import Sampler
from common.core.sampling import Rollout
from common.core.seeds import mix_seed
from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))
from grpo_llm import draw_rows, dynamic_sampling, group_metrics, reward_by_data_source, take_informative_groups  # noqa: E402


class OneProcess:
    """The accelerator calls these helpers make, for one process."""

    gather = staticmethod(lambda t: t)


def part(scores, width=2):
    """A Rollout of len(scores) rows whose prompts are `width` tokens and responses width + 1 (all real)."""
    n, z = len(scores), torch.zeros(len(scores), dtype=torch.bool)
    return Rollout(
        rows=list(range(n)), texts=[str(s) for s in scores], queries=torch.ones(n, width, dtype=torch.long),
        query_mask=torch.ones(n, width), responses=torch.ones(n, width + 1, dtype=torch.long),
        mask=torch.ones(n, width + 1), logprobs=torch.full((n, width + 1), -1.0), is_eos=~z, truncated=z,
        scores=torch.tensor(scores), solved=torch.tensor(scores), logged={"reward/rule": torch.tensor(scores)},
    )  # fmt: skip


def test_draw_rows_gives_each_rank_its_share_and_seeds_by_global_place():
    """Every rank draws the same ids (one sampler state); rank r takes the r-th n/W of them, each repeated; a row's
    seed is mix_seed(seed, step, its place among the step's rows over all ranks and earlier rounds)."""
    rows = [f"p{i}" for i in range(10)]
    n, W, G, seed, step = 4, 2, 3, 7, 5
    for round_ in (0, 1):
        drawn = []
        for rank in range(W):
            sampler = Sampler(len(rows), seed)
            ids = Sampler(len(rows), seed).take(n)  # what every rank's sampler draws
            got, seeds = draw_rows(sampler, rows, n, rank, W, seed, step, repeat=G, round_=round_)
            mine = ids[rank * 2 : rank * 2 + 2]
            assert got == [rows[i] for i in mine for _ in range(G)]
            uids = [round_ * n * G + rank * 2 * G + j for j in range(2 * G)]
            assert seeds == [mix_seed(seed, step, u) for u in uids]
            drawn += seeds
        assert len(set(drawn)) == n * G  # no two rows of a step share a seed


def test_take_informative_groups_fills_fixed_size():
    a = part([1.0, 1.0, 1.0, 1.0], 2)  # both groups equal
    b = part([0.0, 2.0, 2.0, 2.0], 3)  # group 0 informative
    out, filled = take_informative_groups([a, b], 2, 2, pad_id=0)
    assert filled == 1 and out.scores.tolist() == [0.0, 2.0, 1.0, 1.0] and out.texts == ["0.0", "2.0", "1.0", "1.0"]
    assert out.logged["reward/rule"].tolist() == out.solved.tolist() == [0.0, 2.0, 1.0, 1.0]
    assert out.queries.shape == (4, 3) and out.query_mask[2:, 0].eq(0).all()  # left-padded
    assert out.responses.shape == (4, 4) and out.mask[2:, -1].eq(0).all()  # right-padded
    assert out.logprobs[2:, -1].eq(0).all() and out.logprobs[:2].eq(-1).all()
    assert out.query_responses.shape == (4, 7) and out.attention_mask[2:].tolist() == [[0, 1, 1, 1, 1, 1, 1]] * 2


def test_dynamic_sampling_resamples_until_enough_groups_differ():
    """Rounds are sampled while fewer than n_groups groups have differing rewards (at most max_rounds more); the
    shortfall asked is every process's largest (most_missing), so all processes run the same rounds."""
    rounds_scores = [[1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 3.0, 3.0], [0.0, 1.0, 0.0, 1.0]]
    asked = []
    sample_round = lambda k: (asked.append(k), part(rounds_scores[k]))[1]
    out, rounds, filled = dynamic_sampling(sample_round, 2, 2, max_rounds=3, pad_id=0)
    # round 0: one informative group; round 1: none; round 2: two -> enough after 2 extra rounds
    assert asked == [0, 1, 2] and rounds == 2 and filled == 0
    assert out.scores.tolist() == [0.0, 1.0, 0.0, 1.0]  # the first two informative groups, in sampling order
    asked.clear()
    out, rounds, filled = dynamic_sampling(sample_round, 2, 2, max_rounds=1, pad_id=0)
    assert asked == [0, 1] and rounds == 1 and filled == 1  # capped: filled with an equal-reward group
    assert out.scores.tolist() == [0.0, 1.0, 1.0, 1.0]
    asked.clear()  # another process still short: this one samples on although its own groups suffice
    out, rounds, _ = dynamic_sampling(lambda k: part([0.0, 1.0, 0.0, 1.0]), 2, 2, 2, 0, most_missing=lambda n: 1)
    assert rounds == 2 and len(out.rows) == 4


def test_group_metrics_against_numpy():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5])  # 4 groups of 2
    solved = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    got = group_metrics(OneProcess(), scores, solved, 2)
    s, v = scores.numpy().reshape(4, 2), solved.numpy().reshape(4, 2)
    assert got["train/reward"] == pytest.approx(s.mean())
    assert got["train/reward_std"] == pytest.approx(np.std(s, ddof=1))
    assert got["train/zero_std_groups"] == pytest.approx(np.mean([g[0] == g[1] for g in s]))  # 3 of 4
    assert got["train/solve_all"] == pytest.approx(np.mean([g.min() == 1 for g in v]))  # 1 of 4
    assert got["train/solve_none"] == pytest.approx(np.mean([g.max() == 0 for g in v]))  # 2 of 4


def test_samples_rows_carry_the_columns():
    from dataclasses import replace
    from types import SimpleNamespace

    r = replace(part([1.0, 0.0]), rows=[SimpleNamespace(text="a"), SimpleNamespace(text="b")])
    rows = r.samples(torch.tensor([0.5, -1.0]), advantage=torch.tensor([2.0, -2.0]))
    assert rows == [
        {"prompt": "a", "response": "1.0", "reward": 0.5, "advantage": 2.0, "split": "train"},
        {"prompt": "b", "response": "0.0", "reward": -1.0, "advantage": -2.0, "split": "train"},
    ]


def test_reward_by_data_source_is_each_sources_mean_when_the_batch_mixes_them():
    """reward/<source>: the plain mean of its rows' scores; one source: no keys (train/reward says it)."""

    class Row:
        def __init__(self, source):
            self.data_source = source

    sources = ["a", "b", "a", "c", "b", "a"]
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 0.0])
    got = reward_by_data_source([Row(s) for s in sources], scores)
    want = {}
    for s in sorted(set(sources)):
        picked = [float(v) for v, src in zip(scores, sources) if src == s]
        want[f"reward/{s}"] = sum(picked) / len(picked)
    assert got == pytest.approx(want) and list(got) == ["reward/a", "reward/b", "reward/c"]
    assert reward_by_data_source([Row("a"), Row("a")], torch.tensor([1.0, 0.0])) == {}
