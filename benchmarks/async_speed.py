"""Synchronous vs asynchronous GRPO on this machine: wall-clock to a fixed number of updates and samples/s, for
grpo_llm.py and async_grpo.py at K = 0, 1, 2, with the hf (and optionally the vllm) engine; then a model of the
GPU case from the measured phase times. Run it alone on the machine: a second job inflates every number 2-15x.

    python benchmarks/async_speed.py                      # hf engine, 6 updates per row, SmolLM2-135M-Instruct
    python benchmarks/async_speed.py --engines hf vllm --steps 8

Each row is a fresh process on the default task and recipe (8 prompts x 4 samples, <= 64 new tokens); times are
medians over the steps after the first two (the first holds the process start-up of the generator and the first
push; the second, under K >= 1, the pipeline filling). Columns:
  wall_s      the run's wall clock from launch to exit (start-up included)
  step_s      the trainer's median step (time between two updates)
  gen_s       the median time to sample and score one batch (in the generator process for async_grpo.py)
  train_s     the median update (forward and backward passes of the loss)
  busy_s      the trainer's median busy time per step: step_s x (1 - idle) (pi_old / reference forwards, update,
              push, logging)
  push_s      the median weight push (shared memory; waits for the generator included)
  idle        the trainer's median share of its step spent waiting for a batch
  samples/s   rollouts trained on per second of step (32 / step_s)
  model_s     the GPU-case model of a step, each side on a device of its own at full speed: the K = 0 row's
              phases (every core to each side in turn), max(gen_s, busy_s) + push_s for K >= 1; step_s for
              the synchronous rows
On 2 cores the generator and the trainer share the cores when K >= 1 (async_grpo.py: half of them each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ROWS = {  # name: (script, flags)
    "grpo_llm (sync)": ("grpo_llm", []),
    "async K=0": ("async_grpo", ["--max-off-policy-steps", "0"]),
    "async K=0 tis0": ("async_grpo", ["--max-off-policy-steps", "0", "--tis-cap", "0"]),  # grpo_llm's arithmetic
    "async K=1": ("async_grpo", ["--max-off-policy-steps", "1"]),
    "async K=2": ("async_grpo", ["--max-off-policy-steps", "2"]),
}


def run_row(script, flags, engine, steps, out):
    cmd = [sys.executable, str(REPO / "algos" / f"{script}.py"), "--total-steps", str(steps), "--eval-every", "0"]
    cmd += ["--output-dir", out, "--save-every", "0", "--rollout-engine", engine, *flags]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (run,) = [p for p in Path(out).iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][2:]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)
    return {
        "wall_s": wall, "step_s": med("perf/step_s"), "gen_s": med("perf/gen_s"), "train_s": med("perf/train_s"),
        "push_s": med("async/push_s"), "idle": med("async/trainer_idle_frac"), "reward": med("train/reward"),
        "busy_s": med("perf/step_s") * (1 - med("async/trainer_idle_frac")),
    }  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="*", default=["hf"], choices=["hf", "vllm"])
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "async_speed.jsonl"))
    a = p.parse_args()
    header = (
        "| engine | row | steps | wall_s | step_s | gen_s | train_s | busy_s | push_s | idle | samples/s | model_s |"
    )
    print(header + "\n|" + "---|" * (header.count("|") - 1), flush=True)
    for engine in a.engines:
        k0 = None  # the K = 0 row's (gen_s, busy_s): the phases at full speed
        for name in a.rows:
            script, flags = ROWS[name]
            with tempfile.TemporaryDirectory() as out:
                r = run_row(script, flags, engine, a.steps, out)
            if name == "async K=0":
                k0 = (r["gen_s"], r["busy_s"])
            sync = script == "grpo_llm" or "K=0" in name
            model = r["step_s"] if sync or k0 is None else max(k0) + r["push_s"]
            print(f"| {engine} | {name} | {a.steps} | {r['wall_s']:.0f} | {r['step_s']:.1f} | {r['gen_s']:.1f} | "
                  f"{r['train_s']:.1f} | {r['busy_s']:.1f} | {r['push_s']:.2f} | {r['idle']:.2f} | "
                  f"{32 / r['step_s']:.2f} | {model:.1f} |", flush=True)  # fmt: skip
            with open(a.out, "a") as f:
                f.write(json.dumps({"engine": engine, "row": name, "steps": a.steps, **r}) + "\n")


if __name__ == "__main__":
    main()
