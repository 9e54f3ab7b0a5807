"""What the tests of test_async_grpo.py share (tests/*/test_async_grpo.py: the tiers, and other test modules)."""

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # (not conftest's: a launched child imports this module too)

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


# ------------------------------------------------------------------ the weight mailbox (threads stand in for the
# generator process: the same Value / Condition objects)
def _ctx():
    import torch.multiprocessing as mp

    return mp.get_context("spawn")


def _slow_to_start(put, setup_s, then_hang):
    """A generator target: `setup_s` seconds of setup (imports, model load), one batch, then silence if `then_hang`."""
    time.sleep(setup_s)
    put(None)
    put({"x": 1})
    time.sleep(60 if then_hang else 0)


# ------------------------------------------------------------------ the script, end to end
def _flags(model, prompts, out, *extra):
    return [
        "--model-name-or-path", model, "--train-files", prompts, "--reward-fn", TOY_REWARD, "--output-dir", out,
        "--num-prompts", 2, "--group-size", 4, "--mini-batch-size", 8, "--micro-batch-size", 4,
        "--max-new-tokens", 6, "--learning-rate", 3e-3, "--eval-every", 0, "--mixed-precision", "no", *extra,
    ]  # fmt: skip


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "async/"))} for r in rows]
