"""Compare runs without W&B: one PNG, a panel per metric, a line per run (or mean +- std over seeds).

    python -m tools.compare runs/ppo_llm__a__1__* runs/dynamic_kl_ppo__b__1__* \\
        --metrics train/reward train/kl eval/accuracy --smooth 5 --x step --out compare.png

Runs with the same exp_name (from args.json) and different seeds are drawn as one mean line with
a +- std band. Prints a summary table: per run group and metric, the final and best values, the
number of steps, and the wall-clock seconds. Works on run folders of any algos/ script.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro

from common.core.errors import UserError
from common.harness.args import PositiveInt
from common.harness.tracking import json_rows

DEFAULT_METRICS = ["train/reward", "train/kl", "train/entropy", "train/response_len", "eval/accuracy", "loss/policy"]
LOWER_IS_BETTER = ("loss/", "train/kl", "perf/step_s")


def load_run(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a run folder?)")
    rows = json_rows(f, warn=lambda message: print(message, file=sys.stderr))  # a torn last line: skipped
    by_step = {}
    for r in rows:  # a step logged twice (rows of a crashed run, recomputed after its resume): the last one counts
        by_step.setdefault(r["step"], {}).update(r)
    rows = [by_step[k] for k in sorted(by_step)]
    args = json.loads((run_dir / "args.json").read_text()) if (run_dir / "args.json").exists() else {}
    return {
        "dir": run_dir,
        "name": run_dir.name,
        "exp_name": args.get("exp_name", run_dir.name),
        "algo": run_dir.name.split("__")[0],
        "seed": args.get("seed"),
        "rows": rows,
    }


def series(run: dict, metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    """(xs, ys) of one metric; x = step, samples (train/episodes) or time (cumulative perf/step_s)."""
    xs, ys, t = [], [], 0.0
    for r in run["rows"]:
        t += r.get("perf/step_s", 0.0)
        if metric in r:
            xs.append({"step": r["step"], "samples": r.get("train/episodes", r["step"]), "time": t}[x])
            ys.append(r[metric])
    return np.array(xs, dtype=float), np.array(ys, dtype=float)


def align(curves: list[tuple[np.ndarray, np.ndarray]], x: str) -> tuple[np.ndarray, np.ndarray]:
    """Several (xs, ys) curves -> (xs, ys (n_curves, n_points)) on shared x values, never by row index.

    step / samples: the x values every curve has (seeds that crashed early, or logged every 2 steps
    instead of 1, are averaged only where they overlap). time: no two runs share a timestamp, so each
    curve is interpolated onto the union of their x values inside the range they all cover."""
    if len(curves) == 1:
        return curves[0][0], curves[0][1][None]
    if x != "time":
        common = sorted(set.intersection(*(set(xs.tolist()) for xs, _ in curves)))
        xs = np.array(common, dtype=float)
        return xs, np.stack([ys[np.searchsorted(cx, xs)] for cx, ys in curves]) if len(xs) else np.zeros(
            (len(curves), 0)
        )
    lo, hi = max(c[0].min() for c in curves), min(c[0].max() for c in curves)
    xs = np.unique(np.concatenate([c[0] for c in curves]))
    xs = xs[(xs >= lo) & (xs <= hi)]
    return xs, np.stack([np.interp(xs, cx, ys) for cx, ys in curves])


def smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over `window` points (1 = none)."""
    if window <= 1 or len(y) == 0:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = np.empty_like(y)
    for i in range(len(y)):
        lo = max(0, i + 1 - window)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def group_runs(runs: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for r in runs:
        groups[f"{r['algo']}:{r['exp_name']}"].append(r)
    return dict(groups)


def summary(groups: dict[str, list[dict]], metrics: list[str]) -> list[dict]:
    """One row per (group, metric): final and best (mean over seeds), steps, seconds."""
    out = []
    for g, runs in groups.items():
        for m in metrics:
            finals, bests = [], []
            for r in runs:
                _, y = series(r, m, "step")
                if len(y):
                    finals.append(y[-1])
                    bests.append(y.min() if m.startswith(LOWER_IS_BETTER) else y.max())
            if finals:
                out.append(
                    {
                        "group": g,
                        "metric": m,
                        "seeds": len(finals),
                        "final": float(np.mean(finals)),
                        "best": float(np.mean(bests)),
                        "steps": max(r["rows"][-1]["step"] for r in runs),
                        "seconds": float(np.mean([sum(x.get("perf/step_s", 0) for x in r["rows"]) for r in runs])),
                    }
                )
    return out


def plot(groups: dict[str, list[dict]], metrics: list[str], x: str, window: int, out: str) -> int:
    """Write the PNG; returns the number of panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(metrics))
    rows = (len(metrics) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, m in zip(axes.flat, metrics):
        for gi, (g, runs) in enumerate(groups.items()):  # one colour per group in every panel
            curves = [series(r, m, x) for r in runs]
            w = 1 if m.startswith("eval/") else window  # eval points are sparse: never averaged together
            curves = [(xs, smooth(ys, w)) for xs, ys in curves if len(ys)]
            if not curves:
                continue
            xs, ys = align(curves, x)
            if not len(xs):
                continue
            mean = ys.mean(0)
            (line,) = ax.plot(xs, mean, label=f"{g} (n={len(curves)})", color=f"C{gi}")
            if len(curves) > 1:
                std = ys.std(0)
                ax.fill_between(xs, mean - std, mean + std, alpha=0.2, color=line.get_color())
        ax.set_title(m)
        ax.set_xlabel({"step": "step", "samples": "samples", "time": "seconds"}[x])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return len(metrics)


@dataclass
class Args:
    runs: tyro.conf.Positional[list[str]]
    """run folders (runs/{algo}__{exp_name}__{seed}__{time})"""
    metrics: list[str] = field(default_factory=lambda: list(DEFAULT_METRICS))
    """metric keys to plot, one panel each"""
    smooth: PositiveInt = 1
    """trailing moving-average window (points); eval/* metrics are never smoothed"""
    x: str = "step"
    """x-axis: step, samples or time"""
    out: str = "compare.png"
    """output PNG"""


def main(args: Args) -> list[dict]:
    if args.x not in ("step", "samples", "time"):
        raise UserError(f"--x {args.x!r}: use step, samples or time")
    runs = [load_run(r) for r in args.runs]
    groups = group_runs(runs)
    present = [m for m in args.metrics if any(m in row for r in runs for row in r["rows"])]
    missing = sorted(set(args.metrics) - set(present))
    if missing:
        print(f"[compare] not logged by any run, skipped: {missing}")
    if not present:
        raise UserError("[compare] none of --metrics is in these runs")
    plot(groups, present, args.x, args.smooth, args.out)
    table = summary(groups, present)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(runs)} runs -> {args.out}")
    for c in ("group", "metric", "seeds", "final", "best", "steps", "seconds"):
        t.add_column(c)
    for r in table:
        t.add_row(
            r["group"],
            r["metric"],
            str(r["seeds"]),
            f"{r['final']:.4g}",
            f"{r['best']:.4g}",
            str(r["steps"]),
            f"{r['seconds']:.0f}",
        )
    Console(width=140).print(t)
    return table


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
