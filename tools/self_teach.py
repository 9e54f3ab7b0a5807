"""The self-taught chain (STaR / expert iteration; issue 68): a policy's own successful trajectories, SFT on them, and
again from the new checkpoint, round after round, with no program writer and no bigger model.

Each round samples --k trajectories per prompt with the current checkpoint through --env (tools.gen_demos --source
policy: rejection sampling, replayed through the environment, duplicates removed), fine-tunes the current
checkpoint on what it kept (algos/sft_llm.py, a process of its own, as a user runs it) and hands its last checkpoint
folder to the next round. --prefix forces the opening of the first turn (e.g. `<code>`) in the first
--prefix-rounds rounds only: after that the policy opens its calls itself.

    python -m tools.self_teach --prompts data/products_3d/train.parquet data/gcd_3d/train.parquet \\
        --env tools --tools python --tool-format code --prefix '<code>' --rounds 3 --k 4 --out-dir runs/self_teach

OUT_DIR/round_N/ holds the round's demonstrations (demos.jsonl), its summary (summary.json: tried / kept per
data_source) and its SFT run; OUT_DIR/yield.json and the printed table give the yield per round (kept / tried) and
the checkpoint each round sampled with and wrote."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.core import models as M  # noqa: E402
from common.core.errors import UserError  # noqa: E402
from common.harness.args import EnvArgs, Group, NonNegInt, PositiveFloat, PositiveInt, group  # noqa: E402


@dataclass
class Args:
    prompts: list[str]
    """training prompt files in verl's schema (never the held-out ones)"""
    model: str = M.DEFAULT_MODEL
    """the starting policy: hub id or checkpoint folder"""
    rounds: PositiveInt = 3
    """sample -> keep the correct -> SFT, this many times, each from the previous round's checkpoint"""
    k: PositiveInt = 4
    """trajectories sampled per prompt and round"""
    prefix: str = ""
    """text forced at the start of the first turn (e.g. <code>) in the first --prefix-rounds rounds"""
    prefix_rounds: NonNegInt = 1
    """rounds that force --prefix (0: never)"""
    num_prompts: Optional[int] = None
    """use the first N prompts (default: all)"""
    max_per_prompt: PositiveInt = 2
    """demonstrations kept per prompt and round at most"""
    min_reward: float = 1.0
    """a trajectory is kept when its reward reaches this"""
    require_tool: bool = True
    """keep only trajectories with at least one tool call that ran"""
    temperature: PositiveFloat = 1.0
    """sampling temperature"""
    max_new_tokens: PositiveInt = 96
    """tokens per model turn"""
    sft_steps: PositiveInt = 12
    """SFT optimizer steps per round"""
    learning_rate: PositiveFloat = 5e-5
    """SFT learning rate"""
    sft_flags: str = ""
    """more flags for algos/sft_llm.py, as one string (e.g. '--batch-size 8 --lora-r 16')"""
    out_dir: str = "runs/self_teach"
    """the rounds' folders and yield.json"""
    seed: int = 0
    """sampling seed of round 1 (round N: seed + N - 1)"""
    env: Group[EnvArgs] = group(EnvArgs, env="tools", tools="python")
    """the environment the trajectories go through (the training scripts' --env flags)"""


def last_checkpoint(run_parent: Path) -> Path:
    """The policy folder of the latest checkpoint of the one run under `run_parent` (sft_llm.py's --output-dir)."""
    folders = sorted(run_parent.glob("*/checkpoints/step_*/policy"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not folders:
        raise UserError(f"the SFT run under {run_parent} wrote no checkpoint (its log: {run_parent}/sft.log)")
    return folders[-1]


def sft(args: Args, model: str, demos: Path, out: Path) -> Path:
    """algos/sft_llm.py from `model` on `demos` in its own process -> its last checkpoint folder."""
    cmd = [sys.executable, str(REPO / "algos" / "sft_llm.py"), "--model-name-or-path", model, "--train-files",
           str(demos), "--total-steps", str(args.sft_steps), "--learning-rate", str(args.learning_rate),
           "--warmup-steps", str(min(2, args.sft_steps - 1)), "--eval-every", "0", "--output-dir", str(out),
           "--seed", str(args.seed), *shlex.split(args.sft_flags)]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sft.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        tail = (out / "sft.log").read_text().strip().splitlines()[-1:]
        raise UserError(f"SFT of round {out.name} failed (exit {done.returncode}): {' '.join(tail)} ({out}/sft.log)")
    return last_checkpoint(out)


def main(args: Args) -> list[dict]:
    import tools.gen_demos as G

    out_dir, model, table = Path(args.out_dir), args.model, []
    for r in range(1, args.rounds + 1):
        folder = out_dir / f"round_{r}"
        folder.mkdir(parents=True, exist_ok=True)
        demos_args = G.Args(
            prompts=args.prompts, out=str(folder / "demos.jsonl"), source="policy", model=model, k=args.k,
            temperature=args.temperature, prefix=args.prefix if r <= args.prefix_rounds else "",
            require_tool=args.require_tool, min_reward=args.min_reward, max_per_prompt=args.max_per_prompt,
            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, seed=args.seed + r - 1,
            summary_out=str(folder / "summary.json"), show=0, env=replace(args.env),
        )  # fmt: skip
        try:
            report = G.main(demos_args)
        except UserError as e:  # nothing kept: the chain cannot go on from this checkpoint
            table.append({"round": r, "sampled_with": model, "tried": None, "kept": 0, "yield": 0.0, "wrote": None})
            print(f"[self_teach] round {r}: {e}")
            break
        row = {"round": r, "sampled_with": model, "prefix": demos_args.prefix, "tried": report["tried"]}
        row.update(kept=report["kept"], **{"yield": report["kept"] / max(report["tried"], 1)})
        row["per_data_source"] = {s: f"{d['kept']}/{d['tried']}" for s, d in report["per_data_source"].items()}
        model = str(sft(args, model, folder / "demos.jsonl", folder / "sft"))
        row["wrote"] = model
        table.append(row)
        print(f"[self_teach] round {r}: kept {row['kept']}/{row['tried']} ({row['yield']:.3f}); SFT -> {model}")
    (out_dir / "yield.json").write_text(json.dumps(table, indent=2))
    print(
        "| round | sampled with | forced prefix | kept / tried | yield | per data_source |\n|---|---|---|---|---|---|"
    )
    for t in table:
        per = ", ".join(f"{s} {v}" for s, v in t.get("per_data_source", {}).items())
        print(f"| {t['round']} | {t['sampled_with']} | {t.get('prefix') or ''} | {t['kept']} / {t['tried']} | "
              f"{t['yield']:.3f} | {per} |")  # fmt: skip
    return table


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
