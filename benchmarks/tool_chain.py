"""Teach the tool, measured on held-out problems: demonstrations -> multi-turn SFT -> GRPO with the Python tool.

Task families (common.core.tasks): trained on products_3d, gcd_3d, count_bits (demonstrations and RL); chain_sum_4d and
lcm_2d are evaluation only (never in demonstrations or RL). Test problems are split by problem as every built-in
task is. For each family, greedy accuracy question by question of: the base model without tools; the base model
with the tool environment (prompted, untrained); after the SFT warm start (with tools); after SFT + GRPO (with
tools). Gains are over the better base row, with McNemar's exact test on the paired answers.

    python benchmarks/tool_chain.py --demos program     # a program per family writes the calls (tools.gen_demos)
    python benchmarks/tool_chain.py --demos policy      # the base model's own successful trajectories, forced prefix
    python benchmarks/tool_chain.py --demos policy --skip-base --base-from docs/results/tool_chain_program/results.json

Every stage is the command a user runs (tools.gen_demos, algos/sft_llm.py, algos/grpo_llm.py --config
configs/grpo_tools_cpu.yaml), each from the previous stage's checkpoint folder; their seconds are reported. Run it
alone on the machine. Writes results.json, table.md and tool_learning.png into --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from heldout import correct_per_question, correct_with_env, mcnemar_exact  # noqa: E402

TRAINED, HELD_OUT = ("products_3d", "gcd_3d", "count_bits"), ("chain_sum_4d", "lcm_2d")
ENV = {"env": "tools", "tools": "python", "max_turns": 3, "max_trajectory_tokens": 192}
PREFIX = '<tool_call>{"name": "python", "arguments": {"code": "print('


def sh(cmd: list, log: Path, ok=(0,)) -> tuple[float, int]:
    """Run a command (from the repository root), its output to `log`; (seconds taken, exit code). An exit code not in
    `ok` stops here."""
    t0 = time.time()
    print("$", shlex.join(map(str, cmd)), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(list(map(str, cmd)), cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode not in ok:
        raise SystemExit(f"failed ({proc.returncode}): see {log}")
    return time.time() - t0, proc.returncode


def evaluate(model: str, rows: dict, with_tools: bool, max_new_tokens: int) -> dict:
    """{family: {"correct": [bool per question], "tool_calls": mean}}."""
    out = {}
    for fam, r in rows.items():
        if with_tools:
            ok, calls = correct_with_env(model, r, max_new_tokens, ENV)
        else:
            ok, calls = correct_per_question(model, r, max_new_tokens), 0.0
        out[fam] = {"correct": [bool(x) for x in ok], "tool_calls": calls}
        print(f"  {fam}: {sum(ok) / len(ok):.3f} ({'tools' if with_tools else 'plain'}, {calls:.2f} calls)", flush=True)
    return out


def latest_checkpoint(run_dir: Path) -> Path:
    steps = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return steps[-1] / "policy"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", choices=("program", "policy"), default="program")
    ap.add_argument("--out", default=None, help="results folder (default docs/results/tool_chain_<demos>)")
    ap.add_argument("--data-dir", default="data/tool_tasks")
    ap.add_argument("--train-size", type=int, default=400)
    ap.add_argument("--test-size", type=int, default=60)
    ap.add_argument("--policy-prompts", type=int, default=40, help="--demos policy: prompts per family sampled")
    ap.add_argument("--k", type=int, default=8, help="--demos policy: samples per prompt")
    ap.add_argument("--temperature", type=float, default=0.7, help="--demos policy: sampling temperature")
    ap.add_argument("--grpo-args", default="", help="more flags for grpo_llm.py (after the preset's)")
    ap.add_argument("--sft-steps", type=int, default=12)
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--grpo-steps", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--skip-base", action="store_true", help="take the base rows from --base-from")
    ap.add_argument("--base-from", default=None)
    a = ap.parse_args()
    from common.core.chat import load_tokenizer
    from common.core.data import load_prompts
    from common.core.tasks import write_task

    out = Path(a.out or REPO / "docs" / "results" / f"tool_chain_{a.demos}")
    work = REPO / "runs" / f"tool_chain_{a.demos}"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    data, secs = Path(a.data_dir), {}
    t0 = time.time()
    files = {f: write_task(f, data, a.train_size, a.test_size, seed=0) for f in TRAINED + HELD_OUT}
    secs["data"] = time.time() - t0
    tok = load_tokenizer("smollm2-135m-instruct")
    test_rows = {f: load_prompts([str(files[f][1])], tok, max_prompt_length=10_000) for f in files}
    results = {"families": {"trained": TRAINED, "held_out": HELD_OUT}, "seconds": secs, "rows": {}}
    if a.skip_base:
        results["rows"].update(
            {k: v for k, v in json.loads(Path(a.base_from).read_text())["rows"].items() if "base" in k}
        )
    else:
        print("base, plain", flush=True)
        results["rows"]["base"] = evaluate("smollm2-135m-instruct", test_rows, False, a.max_new_tokens)
        print("base, tools", flush=True)
        results["rows"]["base + tools"] = evaluate("smollm2-135m-instruct", test_rows, True, a.max_new_tokens)

    # 1. demonstrations (trained families' training splits only)
    train_files = [files[f][0] for f in TRAINED]
    demos = work / "demos.jsonl"
    if a.demos == "program":
        cmd = ["-m", "tools.gen_demos", "--source", "program", "--prompts", *train_files, "--max-per-prompt", 1]
    else:
        import pandas as pd

        small = []
        for f in TRAINED:  # the first --policy-prompts of each family
            p = work / f"{f}_sampled.parquet"
            pd.read_parquet(files[f][0]).head(a.policy_prompts).to_parquet(p)
            small.append(p)
        cmd = ["-m", "tools.gen_demos", "--source", "policy", "--prompts", *small, "--k", a.k, "--prefix", PREFIX,
               "--temperature", a.temperature,
               "--max-new-tokens", 48, "--rejected-out", work / "rejected.jsonl"]  # fmt: skip
    cmd += ["--out", demos, "--summary-out", out / "demos_summary.json"]
    secs["demos"], rc = sh([sys.executable, *cmd], work / "demos.log", ok=(0, 2))
    results["demos"] = json.loads((out / "demos_summary.json").read_text())
    if rc == 2:  # no demonstration reached the reward: the chain cannot start; what the sampler did instead
        rejected = [json.loads(x) for x in (work / "rejected.jsonl").read_text().splitlines()]
        results["rejected_samples"] = rejected[:: max(1, len(rejected) // 12)][:12]
        (out / "results.json").write_text(json.dumps(results, indent=1))
        raise SystemExit(f"no demonstration kept: {out / 'results.json'} holds the summary and samples")
    # 2. multi-turn SFT from the base model
    sft_cmd = [sys.executable, "algos/sft_llm.py", "--train-files", demos, "--total-steps", a.sft_steps,
               "--batch-size", 16, "--micro-batch-size", 8, "--learning-rate", a.sft_lr, "--warmup-steps", 2,
               "--eval-every", 0, "--output-dir", work, "--exp-name", "sft"]  # fmt: skip
    secs["sft"], _ = sh(sft_cmd, work / "sft.log")
    sft = latest_checkpoint(max(work.glob("sft_llm__sft__*")))
    print("after SFT, tools", flush=True)
    results["rows"]["SFT + tools"] = evaluate(str(sft), test_rows, True, a.max_new_tokens)
    # 3. GRPO with the tool, from the SFT checkpoint, on the trained families
    grpo_cmd = [sys.executable, "algos/grpo_llm.py", "--config", "configs/grpo_tools_cpu.yaml",
                "--model-name-or-path", sft, "--train-files", *train_files, "--total-steps", a.grpo_steps,
                "--output-dir", work, "--exp-name", "grpo", *shlex.split(a.grpo_args)]  # fmt: skip
    secs["grpo"], _ = sh(grpo_cmd, work / "grpo.log")
    grpo_run = max(work.glob("grpo_llm__grpo__*"))
    print("after SFT + GRPO, tools", flush=True)
    results["rows"]["SFT + GRPO + tools"] = evaluate(
        str(latest_checkpoint(grpo_run)), test_rows, True, a.max_new_tokens
    )
    results["grpo_metrics"] = [json.loads(x) for x in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    results["commands"] = {"sft": shlex.join(map(str, sft_cmd)), "grpo": shlex.join(map(str, grpo_cmd))}
    secs["chain_total"] = time.time() - t0  # demonstrations to the last evaluation, base rows included
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_table(results, out)
    plot(results, out / "tool_learning.png")


def write_table(results: dict, out: Path) -> None:
    rows = results["rows"]
    lines = ["| family | split | " + " | ".join(rows) + " | gain over the better base row (b/c, McNemar p) |",
             "|---|---|" + "---|" * len(rows) + "---|"]  # fmt: skip
    for fam in (*TRAINED, *HELD_OUT):
        acc = {k: sum(v[fam]["correct"]) / len(v[fam]["correct"]) for k, v in rows.items()}
        base = max(("base", "base + tools"), key=lambda k: acc[k])
        last = list(rows)[-1]
        b, c, p = mcnemar_exact(rows[base][fam]["correct"], rows[last][fam]["correct"])
        split = "trained" if fam in TRAINED else "**never trained on**"
        cells = " | ".join(f"{acc[k]:.3f}" for k in rows)
        lines.append(f"| {fam} | {split} | {cells} | {100 * (acc[last] - acc[base]):+.1f} ({b}/{c}, p {p:.2g}) |")
    secs = results["seconds"]
    lines.append("")
    lines.append("Seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in secs.items()))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for group, fams, style in (("trained", TRAINED, "-o"), ("held out", HELD_OUT, "--s")):
        acc = [sum(sum(rows[k][f]["correct"]) / len(rows[k][f]["correct"]) for f in fams) / len(fams) for k in rows]
        calls = [sum(rows[k][f]["tool_calls"] for f in fams) / len(fams) for k in rows]
        ax1.plot(range(len(rows)), acc, style, label=f"accuracy, {group}")
        ax1.plot(range(len(rows)), calls, style, alpha=0.5, label=f"tool calls / question, {group}")
    ax1.set_xticks(range(len(rows)), list(rows), rotation=15, fontsize=8)
    ax1.set_title("held-out problems, greedy")
    ax1.legend(fontsize=7)
    m = results["grpo_metrics"]
    for key in ("env/tool_call_rate", "env/tool_success_rate", "env/answer_after_tool", "train/reward"):
        ax2.plot([r["step"] for r in m], [r.get(key, float("nan")) for r in m], label=key)
    ax2.set_xlabel("GRPO step (from the SFT checkpoint)")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_title("tool learning during GRPO")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
