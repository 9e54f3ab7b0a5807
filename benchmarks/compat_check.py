"""Behaviour unchanged across a refactor: every script, float32, a tiny model, run at a base commit and at the
working tree; the metrics of both (all keys but perf/* and async's wall-clock shares) side by side, and a
checkpoint written by the base commit resumed by the working tree (the steps after it compared with the base's).

    python benchmarks/compat_check.py --base 1dbb602            # a table: max relative difference per run
    python benchmarks/compat_check.py --base 1dbb602 --only grpo_default

The base commit is checked out with `git worktree` into a temporary folder (removed after). Each case runs
3 steps with a checkpoint after every step; "resume" continues a copy of the base run from its step-1
checkpoint with the working tree's code. Rows compare key by key: |a - b| / max(|a|, |b|, 1e-12)."""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RL = ["--max-new-tokens", "6", "--num-eval-prompts", "4", "--learning-rate", "1e-3", "--eval-every", "3"]
PPO = RL + ["--batch-size", "4", "--mini-batch-size", "2", "--micro-batch-size", "2"]
GRPO = RL + ["--num-prompts", "2", "--group-size", "2", "--mini-batch-size", "4", "--micro-batch-size", "2"]
PAIRS = ["--batch-size", "4", "--micro-batch-size", "2", "--num-eval-pairs", "4", "--learning-rate", "1e-3"]
CASES = {
    "ppo_default": ("ppo_llm.py", PPO),
    "ppo_lora_kl_target": ("ppo_llm.py", PPO + ["--lora-r", "4", "--kl-target", "0.1", "--whiten-rewards"]),
    "dynamic_kl_ppo": ("dynamic_kl_ppo.py", PPO),
    "grpo_default": ("grpo_llm.py", GRPO),
    "grpo_epochs_kl_dapo": (
        "grpo_llm.py",
        GRPO
        + ["--update-epochs", "2", "--mini-batch-size", "2", "--kl-coef", "0.1", "--clip-eps-high", "0.28"]
        + ["--dynamic-sampling", "--overlong-buffer", "2", "--loss-agg", "token-mean"],
    ),
    "grpo_rloo_tis": ("grpo_llm.py", GRPO + ["--baseline", "rloo", "--scale-rewards", "none", "--tis-cap", "2"]),
    "grpo_env_tools_dynamic": (
        "grpo_llm.py",
        GRPO
        + ["--env", "tools", "--max-turns", "2", "--max-new-tokens", "12", "--dynamic-sampling", "--kl-coef", "0.1"],
    ),
    "ppo_env_feedback": ("ppo_llm.py", PPO + ["--env", "feedback", "--max-turns", "2", "--max-new-tokens", "12"]),
    "async_grpo_k1": ("async_grpo.py", GRPO + ["--max-off-policy-steps", "1"]),
    "dpo_offline": ("dpo_llm.py", PAIRS + ["--num-eval-prompts", "4", "--max-new-tokens", "6", "--sft-coef", "0.1"]),
    "dpo_online": ("dpo_llm.py", PAIRS + ["--online", "--num-eval-prompts", "4", "--max-new-tokens", "6"]),
    "sft": (
        "sft_llm.py",
        ["--batch-size", "4", "--micro-batch-size", "2", "--num-eval-examples", "4", "--num-eval-prompts", "4"]
        + ["--max-new-tokens", "6", "--learning-rate", "1e-3", "--eval-every", "3"],
    ),
    "rm": ("rm_llm.py", PAIRS + ["--num-norm-samples", "4", "--eval-every", "3"]),
}


def run(tree: Path, script: str, flags: list[str], out: Path, extra=()) -> Path:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "algos" / script), *flags, "--output-dir", str(out), *extra]
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{tree.name}: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return sorted(out.iterdir(), key=lambda d: d.stat().st_mtime)[-1]


def rows(run_dir: Path) -> dict:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], {}).update(r)
    return out


TIMINGS = {"async/push_s", "async/trainer_idle_frac", "async/generator_idle_frac"}  # wall-clock, not behaviour


def worst(a: dict, b: dict, steps) -> tuple[float, str]:
    """The largest relative difference over `steps` and every non-perf key of either side, and its key."""
    big, where = 0.0, ""
    for s in steps:
        for k in sorted(set(a.get(s, {})) | set(b.get(s, {}))):
            if k.startswith("perf/") or k == "step" or k in TIMINGS:
                continue
            x, y = a.get(s, {}).get(k), b.get(s, {}).get(k)
            if x is None or y is None:
                return math.inf, f"step {s} {k}: only in {'base' if y is None else 'head'}"
            d = abs(x - y) / max(abs(x), abs(y), 1e-12) if x != y else 0.0
            if d > big:
                big, where = d, f"step {s} {k}: {x:.6g} vs {y:.6g}"
    return big, where


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="commit to compare with")
    p.add_argument("--only", nargs="*", default=None, help="cases to run (default: all)")
    a = p.parse_args()
    from common.core.models import tiny_model

    work = Path(tempfile.mkdtemp(prefix="compat_"))
    base = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), a.base], cwd=REPO, check=True, capture_output=True)
    try:
        tiny = tiny_model(work / "tiny")
        print("| case | fresh run, base vs head (max rel. diff) | base checkpoint resumed by head, steps 2-3 |")
        print("|---|---|---|")
        for name, (script, flags) in CASES.items():
            if a.only and name not in a.only:
                continue
            flags = ["--model-name-or-path", str(tiny), "--mixed-precision", "no", "--total-steps", "3"] + flags
            flags += ["--save-every", "1", "--seed", "3"]
            b = run(base, script, flags, work / name / "base")
            h = run(REPO, script, flags, work / name / "head")
            fresh = worst(rows(b), rows(h), range(0, 4))
            copy = work / name / "resumed" / b.name
            shutil.copytree(b, copy)
            r = run(REPO, script, flags, work / name / "resumed", ["--resume", str(copy / "checkpoints" / "step_1")])
            resumed = worst(rows(b), rows(r), (2, 3))
            cell = lambda d: f"{d[0]:.2g}" + (f" ({d[1]})" if d[0] else "")
            print(f"| {name} | {cell(fresh)} | {cell(resumed)} |", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
