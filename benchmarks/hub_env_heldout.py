"""A hub environment's own score on held-out games, before and after training (issue 67).

    python benchmarks/hub_env_heldout.py --run runs/grpo_llm__... [--games 64] [--out docs/results/hub_env.json]

Reads the run's flags (args.json: --env, --env-system-prompt, --max-turns, budgets), plays `--games` held-out games
(seeds from common.core.tasks.ENV_TEST_SEED0, never trained on) greedily with the base model and the run's last
checkpoint, and prints the environment's reward (mean, and a paired bootstrap 95% interval of the gain) and its win rate
(McNemar's exact test on the paired games). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from heldout import mcnemar_exact  # noqa: E402


def play(model_path: str, env_flags: dict, games: int, max_new_tokens: int) -> tuple[list[float], list[bool]]:
    """Greedy trajectories on the held-out seeds: (the environment's reward per game, won per game)."""
    from common.core import chat as M
    from common.core.rewards import Reward
    from common.core.tasks import ENV_TEST_SEED0, data_source
    from common.harness.args import EnvArgs
    from common.harness.eval import load_any
    from common.integrations.inputs import episodes_from_args

    tok = M.load_tokenizer(model_path)
    model = load_any(model_path, tok).eval()
    env = EnvArgs(**{f.name: env_flags[f.name] for f in dataclasses.fields(EnvArgs) if f.name in env_flags})
    episodes = episodes_from_args(env, tok, Reward("rule:1.0", max_new_tokens=max_new_tokens), "cpu", lambda *a: None)
    src = data_source(env.env)
    rows = [SimpleNamespace(extra_info={"seed": ENV_TEST_SEED0 + i}, uid=i, messages=None, text=src, data_source=src)
            for i in range(games)]  # fmt: skip
    rewards, wins = [], []
    for i in range(0, games, 32):
        ro = episodes.run(model, rows[i : i + 32], None, None, max_new_tokens)
        rewards += ro.scores.tolist()
        wins += (ro.stats["env/win"] > 0).tolist() if "env/win" in ro.stats else (ro.scores >= 1).tolist()
    episodes.close()
    return rewards, wins


def bootstrap_gain(before: list[float], after: list[float], n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A paired bootstrap 95% interval of mean(after - before)."""
    rng, d = random.Random(seed), [a - b for a, b in zip(after, before)]
    means = sorted(sum(rng.choice(d) for _ in d) / len(d) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--run", required=True)
    p.add_argument("--base", default="smollm2-135m-instruct")
    p.add_argument("--games", type=int, default=64)
    p.add_argument("--out", default="")
    a = p.parse_args()
    run = Path(a.run)
    flags = json.loads((run / "args.json").read_text())
    last = max((run / "checkpoints").glob("step_*"), key=lambda c: int(c.name.split("_")[1])) / "policy"
    out = {}
    for name, model in (("base", a.base), (last.parent.name, str(last))):
        rewards, wins = play(model, flags, a.games, flags["max_new_tokens"])
        out[name] = {
            "reward": sum(rewards) / len(rewards),
            "win": sum(wins) / len(wins),
            "rewards": rewards,
            "wins": wins,
        }
    (b, t) = out.values()
    lo, hi = bootstrap_gain(b["rewards"], t["rewards"])
    nb, nc, pval = mcnemar_exact(b["wins"], t["wins"])
    summary = {"env": flags["env"], "games": a.games, "base": {k: b[k] for k in ("reward", "win")},
               "trained": {k: t[k] for k in ("reward", "win")}, "checkpoint": str(last),
               "reward_gain_95ci": [lo, hi], "win_mcnemar": {"b": nb, "c": nc, "p": pval}}  # fmt: skip
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({**summary, "per_game": out}, indent=2))


if __name__ == "__main__":
    main()
