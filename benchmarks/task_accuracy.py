"""Greedy exact-match accuracy of a model on each built-in task's test split (which tasks leave room for RL).

python benchmarks/task_accuracy.py [--model smollm2-135m-instruct] [--num-prompts 64] [--max-new-tokens 64]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.core import chat, defaults
from common.core import models as M  # noqa: E402
from common.core.data import load_prompts  # noqa: E402
from common.core.rewards import Reward  # noqa: E402
from common.core.tasks import TASKS, default_task_files  # noqa: E402
from common.harness.eval import answer, score  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=defaults.DEFAULT_MODEL)
    p.add_argument("--tasks", nargs="*", default=list(TASKS))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    tok = chat.load_tokenizer(a.model)
    model = M.load_causal_lm(a.model, tok).eval()
    reward = Reward("rule:1.0", max_new_tokens=a.max_new_tokens)
    print("| task | prompts | greedy accuracy (exact) | mean reward | seconds |\n|---|---|---|---|---|")
    for task in a.tasks:
        rows = load_prompts([default_task_files(task, test_size=a.num_prompts)[1]], tok)[: a.num_prompts]
        t0 = time.time()
        res = score(rows, answer(model, tok, rows, a.max_new_tokens, batch_size=32, temperature=0.0), reward)["all"]
        print(
            f"| {task} | {res['n']} | {res['accuracy']:.3f} | {res['reward']:.3f} | {time.time() - t0:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
