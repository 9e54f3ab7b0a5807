"""The Python tool's calls per second under each --tool-sandbox mode (common/integrations/sandbox.py): an ordinary
program (math, fractions, itertools, printing), a trivial one, and one that imports more of the standard library; with
--base COMMIT also that commit's run_python (the tool before a change), in the same run. Run it alone:

    python benchmarks/tool_sandbox.py [--calls 40] [--base 5b47430]

Prints a markdown table (docs/agents.md quotes it)."""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.integrations.sandbox import run_python  # noqa: E402

PROGRAMS = {
    "print(1)": "print(1)",
    "math, fractions, itertools": (
        "import math, fractions, itertools\n"
        "print(math.factorial(20), fractions.Fraction(3, 9) + 1, sum(1 for _ in itertools.permutations(range(6))))"
    ),
    "+ decimal, statistics, json, re": (
        "import decimal, statistics, json, re\nprint(statistics.mean([1, 2, 3]), json.dumps({'a': 1}), re.sub('a', 'b', 'aa'))"
    ),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--base", default="", help="a commit whose common/integrations/sandbox.py is measured too")
    args = parser.parse_args()
    runners = {
        "audit": partial(run_python, sandbox="audit"),
        "namespaces, no seccomp": partial(run_python, _seccomp=False),
        "namespaces": run_python,  # (with the seccomp filter: the default)
    }
    if args.base:  # that commit's module, loaded under another name (it imports nothing of ours but common.core.errors)
        src = subprocess.run(["git", "show", f"{args.base}:common/integrations/sandbox.py"], capture_output=True, text=True,
                             check=True, cwd=REPO).stdout  # fmt: skip
        path = Path(tempfile.mkdtemp()) / "base_sandbox.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("base_sandbox", path)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        runners = {f"{args.base}": base.run_python, **runners}
    print("| program | " + " | ".join(f"{k}: calls/s" for k in runners) + " |")
    print("|---|" + "---|" * len(runners))
    for name, code in PROGRAMS.items():
        rates = []
        for run in runners.values():
            run(code)  # warm: the page cache, the first fork
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                out, ok = run(code)
                times.append(time.perf_counter() - t0)
                assert ok, out
            rates.append(1 / statistics.median(times))
        print(f"| `{name}` | " + " | ".join(f"{r:.1f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
