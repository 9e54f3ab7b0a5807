"""The Python tool's calls per second under each --tool-sandbox mode (common/sandbox.py): an ordinary program (math,
fractions, itertools, printing), a trivial one, and one that imports more of the standard library. Run it alone:

    python benchmarks/tool_sandbox.py [--calls 40]

Prints a markdown table (docs/agents.md quotes it)."""

import argparse
import statistics
import time

from common.sandbox import run_python

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
    args = parser.parse_args()
    print("| program | audit: calls/s | namespaces: calls/s | namespaces / audit |")
    print("|---|---|---|---|")
    for name, code in PROGRAMS.items():
        rates = {}
        for sandbox in ("audit", "namespaces"):
            run_python(code, sandbox=sandbox)  # warm: the page cache, the first fork
            times = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                out, ok = run_python(code, sandbox=sandbox)
                times.append(time.perf_counter() - t0)
                assert ok, out
            rates[sandbox] = 1 / statistics.median(times)
        print(
            f"| `{name}` | {rates['audit']:.1f} | {rates['namespaces']:.1f} | {rates['namespaces'] / rates['audit']:.2f} |"
        )


if __name__ == "__main__":
    main()
