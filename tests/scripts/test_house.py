"""The house rules, checked: copied code stays identical (TRL's rule), the library stays apart from
the tools, and the algorithm (losses, advantages, KL controllers) lives in the scripts."""

import sys

import pytest


@pytest.mark.e2e
def test_the_zygote_runs_ranks_together_and_ends_them_as_torchrun_does(tmp_path):
    """Zygote.run_ranks: the ranks run at once (each waits for the other's file), every rank's output comes back,
    and when one fails the others are ended (SIGTERM) with the failure's exit code, not left waiting."""
    import os
    import time

    from conftest import REPO as repo
    from zygote import Zygote

    z = Zygote(tmp_path / "z")
    try:
        script = repo / "algos" / "_rank_probe.py"  # the zygote serves scripts of algos/ only: a temporary one
        script.write_text(
            "import os, sys, time, pathlib\nd = pathlib.Path(sys.argv[1]); r = os.environ['RANK']\n"
            "(d / r).write_text(r)\nfor _ in range(100):\n    if len(list(d.iterdir())) == 2: break\n"
            "    time.sleep(0.05)\nelse: sys.exit(3)\nprint('rank', r, 'saw both')\n"
            "if r == '1' and len(sys.argv) > 2: sys.exit(5)\nif len(sys.argv) > 2: time.sleep(60)\n"
        )
        envs = [{**os.environ, "RANK": str(r)} for r in range(2)]
        (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
        argv = [sys.executable, str(script), str(tmp_path / "a")]
        proc = z.run_ranks(argv, envs, 60, repo)
        assert proc.returncode == 0 and "rank 0 saw both" in proc.stdout and "rank 1 saw both" in proc.stdout
        t0 = time.monotonic()
        proc = z.run_ranks([*argv[:2], str(tmp_path / "b"), "fail"], envs, 60, repo)
        assert proc.returncode == 5 and time.monotonic() - t0 < 20  # rank 0's 60 s sleep was ended
    finally:
        script.unlink(missing_ok=True)
        z.close()
