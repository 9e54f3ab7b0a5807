"""Scorers, the registry, custom functions, weighted mixes, failures."""

import time
from pathlib import Path

import pytest


@pytest.mark.e2e
def test_reward_workers_die_with_the_trainer(tmp_path):
    """A trainer that exits at once (a second Ctrl-C: os._exit) or is killed left its two reward workers as
    orphans of ~480 MB each (issue 38): they now die with it (PR_SET_PDEATHSIG)."""
    import subprocess
    import sys

    (tmp_path / "pid.py").write_text(
        "import os\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'pid': os.getpid()}\n"
    )
    code = (
        "import os, sys, torch\nsys.path.insert(0, sys.argv[1])\nfrom common.core.rewards import Reward\n"
        "from common.core.data import PromptRow\n"
        f"r = Reward('rule:1.0', '{tmp_path}/pid.py:score', workers=2)\n"
        "rows = [PromptRow('p', 'x', None, {}, i) for i in range(4)]\n"
        "r(rows, ['a'] * 4, torch.ones(4))\n"
        # the pool's processes, not the pids the rows report: one worker may take all four rows before the other
        # has started (CI saw one pid under load), and every worker must die
        "print(*sorted(r.pool.pool._processes), flush=True)\n"
        "os._exit(130)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2])], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    pids = [int(p) for p in out.stdout.split()]
    assert out.returncode == 130 and len(pids) == 2, out.stderr[-2000:]
    deadline = time.monotonic() + 10

    def alive(pid):
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False

    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), pids
