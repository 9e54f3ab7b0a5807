"""Held-out gains: does RL teach something that transfers to problems never trained on?

For each task x algorithm x seed: run the script's default recipe (plus any --script-args) for a
wall-clock budget (--max-wall-minutes: the step that passes the budget is the last), then greedy
accuracy on a test set of the task split *by problem* (common.core.tasks: a hash-chosen share of the
problems is test-only, in any order of their operands; the overlap with the training file is checked
and printed, and must be 0) for the base model and the final checkpoint, question by question.
The gain's significance is McNemar's exact test on the paired answers (b = questions wrong before
and right after, c = right before and wrong after; p = two-sided binomial(b + c, 1/2)). Also
printed: what answering the training set's most common answer to every test question would score,
since a model can gain held-out points by learning the answer distribution alone.

    python benchmarks/heldout.py --algos ppo grpo --tasks chain_sum_1d letter_counting --minutes 15
    python benchmarks/heldout.py --algos grpo ppo --tasks basic_arithmetic_1d --minutes 30
    python benchmarks/heldout.py --algos grpo --tasks chain_sum --minutes 15 --tag lr2e5 --script-args "--learning-rate
    2e-5" python benchmarks/heldout.py --evaluate runs/heldout/grpo_llm__...   # score an existing run folder

Run it alone on the machine: a second job slows every step, and fewer steps fit the budget.
Each result is appended to --out (JSON lines), from which docs/results.md's table is made.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SCRIPTS = {"ppo": "ppo_llm", "grpo": "grpo_llm", "dkl": "dynamic_kl_ppo", "async": "async_grpo"}


def mcnemar_exact(before: list[bool], after: list[bool]) -> tuple[int, int, float]:
    """(b, c, p): b = wrong before and right after, c = right before and wrong after; p = the exact
    two-sided McNemar test, i.e. 2 * P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), capped at 1."""
    if len(before) != len(after):
        raise ValueError(f"paired answers differ in length: {len(before)} vs {len(after)}")
    b = sum(1 for x, y in zip(before, after) if not x and y)
    c = sum(1 for x, y in zip(before, after) if x and not y)
    n = b + c
    if n == 0:
        return b, c, 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return b, c, min(1.0, 2 * tail)


def majority_answer_accuracy(train_rows: list[dict], test_rows: list[dict]) -> tuple[str, float]:
    """The training set's most common ground truth, and its accuracy if answered to every test question."""
    common = Counter(str(r["reward_model"]["ground_truth"]) for r in train_rows).most_common(1)[0][0]
    hits = sum(str(r["reward_model"]["ground_truth"]) == common for r in test_rows)
    return common, hits / max(len(test_rows), 1)


def test_file(task: str, test_size: int, train_file: str) -> tuple[str, dict]:
    """A test split of `task` with up to `test_size` questions (the same hash-chosen test problems as the
    scripts' own test split, more of them), and its overlap with the training file (must be none)."""
    from common.core.data import overlap_report, read_table, write_rows
    from common.core.defaults import cache_dir
    from common.core.tasks import split_task_rows

    path = cache_dir() / "data" / f"heldout_{task}_{test_size}" / "test.parquet"
    if not path.exists():
        _, rows = split_task_rows(task, 0, test_size, seed=0)
        write_rows(rows, path)
    overlap = overlap_report(read_table(train_file), read_table(str(path)))
    if overlap["test_rows_with_problem_in_train"]:
        raise SystemExit(
            f"{path}: {overlap['test_rows_with_problem_in_train']} test rows share a problem with {train_file}"
        )
    return str(path), overlap


def correct_per_question(model_path: str, rows, max_new_tokens: int) -> list[bool]:
    """Greedy answer to each row, scored exact-match by the task's own scorer."""
    import torch

    from common.core import chat as M
    from common.core.rewards import Reward
    from common.harness.eval import answer, load_any

    tok = M.load_tokenizer(model_path)
    model = load_any(model_path, tok).eval()
    texts, lengths, eos = answer(model, tok, rows, max_new_tokens, batch_size=32, temperature=0.0, with_lengths=True)
    reward = Reward("rule:1.0", max_new_tokens=max_new_tokens)
    s, _, extra = reward(rows, [t[0] for t in texts], torch.tensor([n[0] for n in lengths]), is_eos=[e[0] for e in eos])
    return [bool(a) for a in extra.get("acc", (s >= 1).float()).tolist()]


def correct_with_env(model_path: str, rows, max_new_tokens: int, env_flags: dict) -> tuple[list[bool], float]:
    """Greedy trajectories through the environment of `env_flags` (a run's --env, --max-turns, ...; common.core.envs):
    (solved per question: the feedback environment's solved_turn > 0, else the trajectory's reward >= 1; the mean
    tool calls per trajectory)."""
    import dataclasses

    from common.core import chat as M
    from common.core.rewards import Reward
    from common.harness.args import EnvArgs
    from common.harness.eval import load_any
    from common.integrations.inputs import episodes_from_args

    tok = M.load_tokenizer(model_path)
    model = load_any(model_path, tok).eval()
    env = EnvArgs(**{f.name: env_flags[f.name] for f in dataclasses.fields(EnvArgs) if f.name in env_flags})
    episodes = episodes_from_args(env, tok, Reward("rule:1.0", max_new_tokens=max_new_tokens), "cpu", lambda *a: None)
    solved, calls = [], []
    for i in range(0, len(rows), 32):
        ro = episodes.run(model, rows[i : i + 32], None, None, max_new_tokens)
        ok = ro.stats["env/solved_turn"] > 0 if "env/solved_turn" in ro.stats else ro.scores >= 1
        solved += ok.tolist()
        calls += ro.stats.get("env/tool_calls", ro.scores * 0).tolist()
    return solved, sum(calls) / len(calls)


def train(algo, task, seed, minutes: float, steps: int, tag: str, script_args: list[str], out_dir: str) -> Path:
    """Runs the script for `minutes` of wall time (0: no limit) or `steps` iterations (0: no limit); returns its run
    folder."""
    exp = f"heldout_{task}_{tag}"
    cmd = [sys.executable, str(REPO / "algos" / f"{SCRIPTS[algo]}.py"), "--task", task, "--seed", str(seed)]
    cmd += ["--exp-name", exp, "--output-dir", out_dir, "--max-wall-minutes", str(minutes)]
    cmd += ["--total-steps", str(steps or 100_000)]
    cmd += script_args
    print("$", shlex.join(cmd), flush=True)
    before = set(Path(out_dir).glob(f"{SCRIPTS[algo]}__{exp}__{seed}__*"))
    subprocess.run(cmd, check=True, cwd=REPO)
    (run,) = set(Path(out_dir).glob(f"{SCRIPTS[algo]}__{exp}__{seed}__*")) - before
    return run


def evaluate_run(run: Path, test_size: int, base_cache: dict) -> dict:
    """Before/after greedy accuracy of a finished run on the task's held-out test set."""
    from common.core import chat as M
    from common.core.data import load_prompts
    from common.core.tasks import default_task_files
    from common.harness.checkpoint import list_checkpoints

    args = json.loads((run / "args.json").read_text())
    task, new_tokens = args["task"], int(args["max_new_tokens"])
    train_file = (args.get("train_files") or [default_task_files(task)[0]])[0]
    path, overlap = test_file(task, test_size, train_file)
    ckpt = max(list_checkpoints(run), key=lambda p: int(p.name[5:]))
    base = args["model_name_or_path"]
    tok = M.load_tokenizer(base)
    rows = load_prompts([path], tok, log=lambda *a: None)
    key = (base, path, new_tokens)
    if key not in base_cache:
        base_cache[key] = correct_per_question(base, rows, new_tokens)
    before = base_cache[key]
    after = correct_per_question(str(ckpt / "policy"), rows, new_tokens)
    env_rows = {}
    if args.get("env"):  # a multi-turn run: each model with and without its environment, and the base with tools
        base_env, _ = correct_with_env(base, rows, new_tokens, args)
        base_tools, base_calls = correct_with_env(
            base, rows, new_tokens, args | {"env": "tools", "tools": "calculator"}
        )
        after_plain, after_env = after, correct_with_env(str(ckpt / "policy"), rows, new_tokens, args)[0]
        env_rows = {"base_plain": sum(before) / len(before), "base_env": sum(base_env) / len(base_env),
                    "base_tools": sum(base_tools) / len(base_tools), "base_tool_calls": base_calls,
                    "after_plain": sum(after_plain) / len(after_plain)}  # fmt: skip
        # the gain is measured against the better base row, with the environment after training
        before = before if sum(before) >= sum(base_env) else base_env
        after = after_env
    b, c, p = mcnemar_exact(before, after)
    from common.core.data import read_table

    common, maj = majority_answer_accuracy(read_table(train_file), read_table(path))
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {
        "run": str(run),
        "script": run.name.split("__")[0],
        "task": task,
        "seed": args["seed"],
        "steps": int(ckpt.name[5:]),
        "train_minutes": round(sum(m.get("perf/step_s", 0.0) for m in metrics) / 60, 1),  # steps only, no evals
        "max_new_tokens": new_tokens,
        "test_questions": len(rows),
        "distinct_test_problems": overlap["distinct_test_problems"],
        "test_problems_in_train": overlap["distinct_test_problems_in_train"],
        "before": sum(before) / len(before),
        "after": sum(after) / len(after),
        "wrong_to_right": b,
        "right_to_wrong": c,
        "p_mcnemar": p,
        "majority_answer": common,
        "majority_answer_accuracy": maj,
    } | env_rows


def row(r: dict, tag: str = "") -> str:
    gain = 100 * (r["after"] - r["before"])
    return (
        f"| {r['task']} | {r['script']} | {tag or '-'} | {r['seed']} | {r['steps']} | {r['train_minutes']} | "
        f"{r['test_questions']} ({r['distinct_test_problems']}) | {r['before']:.3f} | {r['after']:.3f} | {gain:+.1f} | "
        f"{r['wrong_to_right']}/{r['right_to_wrong']} | {r['p_mcnemar']:.2g} | {r['majority_answer_accuracy']:.3f} |"
    )


HEADER = (
    "| task | script | recipe | seed | steps | train min | test questions (problems) | before | after | gain (points) "
    "| wrong→right / right→wrong | McNemar p | most-common-answer baseline |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algos", nargs="*", default=["ppo", "grpo"], choices=list(SCRIPTS))
    p.add_argument("--tasks", nargs="*", default=["chain_sum_1d", "basic_arithmetic_1d", "letter_counting"])
    p.add_argument("--seeds", nargs="*", type=int, default=[1])
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock training budget per run (0: none)")
    p.add_argument("--steps", type=int, default=0, help="or a budget in iterations (0: none); the runs' step")
    p.add_argument("--test-size", type=int, default=200, help="test questions per task (fewer if the task has fewer)")
    p.add_argument("--tag", default="default", help="names the recipe in the table and the runs' exp_name")
    p.add_argument("--script-args", default="", help="extra flags for every script, e.g. '--learning-rate 2e-5'")
    p.add_argument("--output-dir", default="runs/heldout")
    p.add_argument("--evaluate", nargs="*", default=[], help="score these finished run folders instead of training")
    p.add_argument("--out", default="runs/heldout/results.jsonl", help="results appended here as JSON lines")
    a = p.parse_args()

    runs = [(Path(r), a.tag) for r in a.evaluate]
    if not runs:
        for task in a.tasks:
            for algo in a.algos:
                for seed in a.seeds:
                    t0 = time.time()
                    if not (a.minutes or a.steps):
                        p.error("--minutes 0 needs --steps N")
                    run = train(algo, task, seed, a.minutes, a.steps, a.tag, shlex.split(a.script_args), a.output_dir)
                    print(f"{run}: {time.time() - t0:.0f} s", flush=True)
                    runs.append((run, a.tag))
    base_cache, results = {}, []
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for run, tag in runs:
        r = evaluate_run(run, a.test_size, base_cache) | {"tag": tag, "script_args": a.script_args}
        results.append(r)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        print(HEADER if len(results) == 1 else "", row(r, tag), sep="\n" if len(results) == 1 else "", flush=True)
    print("\n" + HEADER)
    for r in results:
        print(row(r, r["tag"]))


if __name__ == "__main__":
    main()
