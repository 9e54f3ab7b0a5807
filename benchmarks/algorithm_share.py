"""How much of each RL script is the algorithm (issue 31's measure), at any git revision.

    python benchmarks/algorithm_share.py                 # the working tree
    python benchmarks/algorithm_share.py e0c6e21 HEAD    # revisions side by side

Counted with `ast`, non-blank lines: the Args section headed `# --- algorithm`, every top-level function or
class other than `main` and `Args` (losses, advantages, KL controllers), and in `main` the lines from the
"2." phase heading up to the "log" phase heading (scoring, advantages, the update, KL control); over the
script's non-blank lines. Setup, the rollout call and logging count as harness."""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("ppo_llm", "grpo_llm", "dynamic_kl_ppo")


def algorithm_lines(src: str) -> tuple[int, int]:
    lines = src.split("\n")
    algo = 0
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name not in ("main", "Args"):
            algo += sum(1 for line in lines[node.lineno - 1 : node.end_lineno] if line.strip())
        if isinstance(node, ast.ClassDef) and node.name == "Args":
            inside = False
            for line in lines[node.lineno - 1 : node.end_lineno]:
                if line.strip().startswith("# --- algorithm"):
                    inside = True
                    continue
                if inside and (line.strip().startswith("# ---") or line.strip().startswith("health:")):
                    inside = False
                algo += inside and bool(line.strip())
    start = next(i for i, line in enumerate(lines) if re.search(r"# -{10,} 2\. ", line))
    end = next(i for i, line in enumerate(lines) if re.search(r"# -{10,} \d\. log", line))
    algo += sum(1 for line in lines[start:end] if line.strip())
    return algo, sum(1 for line in lines if line.strip())


def main(revs: list[str]) -> None:
    print("| revision | script | lines | algorithm (non-blank) | share |\n|---|---|---|---|---|")
    for rev in revs or ["working tree"]:
        for name in SCRIPTS:
            path = f"algos/{name}.py"
            src = (
                (REPO / path).read_text()
                if rev == "working tree"
                else subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True).stdout
            )
            algo, total = algorithm_lines(src)
            print(f"| {rev} | {name} | {len(src.splitlines())} | {algo} of {total} | {100 * algo / total:.0f} % |")


if __name__ == "__main__":
    main(sys.argv[1:])
