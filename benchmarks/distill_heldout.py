"""On-policy distillation against its baselines, held out (issue 36): from a GRPO teacher's run folder, the base
model is (1) distilled on-policy (algos/distill_llm.py) and (2) fine-tuned on teacher samples (off-policy
distillation: the teacher answers the training prompts at temperature 1, algos/sft_llm.py trains on them), each
for the same wall-clock budget, sample generation included; then greedy accuracy on the task's held-out test set
(benchmarks/heldout.py: split by problem, McNemar against the base) for the base, the teacher, and both students,
and the runs' eval/accuracy against training wall-clock (perf/step_s summed; the GRPO teacher's own curve is
"GRPO from the base"). Prints a table; --plot writes the curves. Run it alone on the machine.

    python benchmarks/heldout.py --algos grpo --tasks basic_arithmetic_1d --minutes 30 --output-dir runs/heldout36
    python benchmarks/distill_heldout.py --teacher-run runs/heldout36/grpo_llm__... --minutes 15 --plot
    docs/img/distill.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def curve(run: Path) -> list[tuple[float, float]]:
    """(training minutes so far, eval/accuracy) at each evaluation of a run."""
    out, t = [], 0.0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        t += r.get("perf/step_s", 0.0)
        if "eval/accuracy" in r:
            out.append((t / 60, r["eval/accuracy"]))
    return out


def script(name: str, out_dir: Path, *flags) -> Path:
    before = set(out_dir.glob(f"{name}__*"))
    subprocess.run([sys.executable, str(REPO / "algos" / f"{name}.py"), *map(str, flags), "--output-dir", str(out_dir)],
                   check=True, cwd=REPO)  # fmt: skip
    (run,) = set(out_dir.glob(f"{name}__*")) - before
    return run


def teacher_samples(teacher: str, train_file: str, n: int, max_new_tokens: int, out: Path) -> None:
    """The teacher's answers (temperature 1, one each) to the first `n` training prompts, as an SFT file."""
    from common.core import chat as M
    from common.core.data import load_prompts, read_table, write_rows
    from common.harness.eval import answer, load_any

    tok = M.load_tokenizer(teacher)
    raw = read_table(train_file)[:n]
    rows = load_prompts([train_file], tok, log=lambda *a: None)[:n]
    texts = answer(load_any(teacher, tok).eval(), tok, rows, max_new_tokens, batch_size=32, temperature=1.0, seed=1)
    write_rows([{"prompt": r["prompt"], "response": t[0]} for r, t in zip(raw, texts)], out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher-run", required=True, help="a finished grpo_llm.py run folder (its last checkpoint)")
    p.add_argument("--minutes", type=float, default=15.0, help="wall-clock budget of each student")
    p.add_argument("--sft-samples", type=int, default=1024, help="teacher answers the SFT student trains on")
    p.add_argument("--test-size", type=int, default=200)
    p.add_argument("--distill-args", default="", help="extra flags for distill_llm.py")
    p.add_argument("--plot", default="", help="write the accuracy-vs-wall-clock curves here (png)")
    p.add_argument("--out", default="runs/heldout36/distill.json")
    a = p.parse_args()
    from heldout import correct_per_question, mcnemar_exact, test_file

    from common.core.tasks import default_task_files
    from common.harness.checkpoint import list_checkpoints, step_of

    teacher_run = Path(a.teacher_run)
    args = json.loads((teacher_run / "args.json").read_text())
    task, tokens, base, out_dir = (
        args["task"],
        int(args["max_new_tokens"]),
        args["model_name_or_path"],
        teacher_run.parent,
    )
    teacher = str(max(list_checkpoints(teacher_run), key=step_of) / "policy")
    train_file = default_task_files(task)[0]
    common = ["--task", task, "--model-name-or-path", base, "--max-new-tokens", tokens, "--seed", 1]

    t0 = time.time()
    distill = script("distill_llm", out_dir, "--teacher", teacher, *common, "--max-wall-minutes", a.minutes,
                     "--total-steps", 10_000, "--eval-every", 10, *a.distill_args.split())  # fmt: skip
    distill_s = time.time() - t0
    t0 = time.time()
    sft_file = out_dir / f"teacher_samples_{task}.jsonl"
    teacher_samples(teacher, train_file, a.sft_samples, tokens, sft_file)
    gen_min = (time.time() - t0) / 60
    sft = script("sft_llm", out_dir, "--train-files", sft_file, "--task", task, "--model-name-or-path", base,
                 "--max-new-tokens", tokens, "--seed", 1, "--max-wall-minutes", max(1.0, a.minutes - gen_min),
                 "--total-steps", 10_000, "--eval-every", 25,
                 "--eval-prompt-files", default_task_files(task)[1])  # fmt: skip
    sft_s = time.time() - t0

    from common.core import chat as M
    from common.core.data import load_prompts

    path, _ = test_file(task, a.test_size, train_file)
    rows = load_prompts([path], M.load_tokenizer(base), log=lambda *a: None)
    models = {
        "base": base,
        "GRPO (the teacher)": teacher,
        "on-policy distillation": None,
        "SFT on teacher samples": None,
    }
    models["on-policy distillation"] = str(max(list_checkpoints(distill), key=step_of) / "policy")
    models["SFT on teacher samples"] = str(max(list_checkpoints(sft), key=step_of) / "policy")
    correct = {k: correct_per_question(v, rows, tokens) for k, v in models.items()}
    minutes = {"base": 0.0, "GRPO (the teacher)": curve(teacher_run)[-1][0], "on-policy distillation": distill_s / 60,
               "SFT on teacher samples": sft_s / 60}  # fmt: skip
    print(f"\n{task}: {len(rows)} held-out questions, greedy, {tokens} new tokens\n")
    print("| model | wall-clock (min) | held-out accuracy | wrong→right / right→wrong vs base | McNemar p |")
    print("|---|---|---|---|---|")
    results = {}
    for k, c in correct.items():
        b, cc, pv = mcnemar_exact(correct["base"], c)
        results[k] = {"accuracy": sum(c) / len(c), "minutes": minutes[k], "b": b, "c": cc, "p": pv}
        print(f"| {k} | {minutes[k]:.1f} | {sum(c) / len(c):.3f} | {b}/{cc} | {pv:.2g} |")
    curves = {"GRPO from the base": curve(teacher_run), "on-policy distillation": curve(distill),
              "SFT on teacher samples": [(gen_min + t, acc) for t, acc in curve(sft)]}  # fmt: skip
    goal = 0.9 * curves["GRPO from the base"][-1][1]
    reach = {k: next((t for t, acc in c if acc >= goal), None) for k, c in curves.items()}
    print(f"\nfirst eval/accuracy >= {goal:.3f} (0.9 x the teacher's last): " + "; ".join(
        f"{k} {'never' if t is None else f'{t:.1f} min'}" for k, t in reach.items()))  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"results": results, "curves": curves, "reach": reach, "goal": goal,
                                       "runs": {"teacher": str(teacher_run), "distill": str(distill), "sft": str(sft)}},
                                      indent=1))  # fmt: skip
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for k, c in curves.items():
            ax.plot([t for t, _ in c], [acc for _, acc in c], marker="o", ms=3, label=k)
        ax.axhline(goal, ls=":", c="gray", label="0.9 x the teacher")
        ax.set(xlabel="training wall-clock (min, 2 CPU cores)", ylabel="eval/accuracy (64 held-out questions)",
               title=f"SmolLM2-135M-Instruct (Q4_1 GGUF) on {task}")  # fmt: skip
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)


if __name__ == "__main__":
    main()
