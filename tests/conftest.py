"""Shared fixtures (tiny random models saved to folders and loaded through the users' code path) and the
test tiers.

Tiers (pytest.ini): a test that launches a script, a tool or a launcher as a process carries a marker:
    smoke        one short run per script (the fast tier's only launches: tests/test_smoke.py)
    e2e          other script or tool runs as processes (resume, learning, pipelines, refusals)
    distributed  `accelerate launch` / torchrun with 2-4 processes
    vllm         the vLLM engine
    slow         the real SmolLM2-135M-Instruct model, or minutes of training
`python -m pytest -q` (the README's test command) runs the unmarked tests and the smoke runs;
`python -m pytest -q -m ""` runs everything, as CI does. The guard below fails an unmarked test that
launches a Python process, so the fast tier cannot grow back into the full suite.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A 2-layer, hidden-64 Llama with the SmolLM2 tokenizer (init std 0.02)."""
    from common.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_peaky(tmp_path_factory):
    """The same with init std 0.2: peaky next-token distributions, for learning tests."""
    from common.models import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny_peaky"), init_std=0.2)


@pytest.fixture(scope="session")
def toy_prompts(tmp_path_factory):
    """32 short prompts in verl's schema with data_source 'toy' (scored by tests/toy_reward.py)."""
    path = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    words = ["hi", "hello", "count", "go", "yes", "no", "up", "down"]
    with open(path, "w") as f:
        for i in range(32):
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"{words[i % 8]} {i}"}],
                        "data_source": "toy",
                        "reward_model": {"style": "rule", "ground_truth": ""},
                        "extra_info": {"index": i},
                    }
                )
                + "\n"
            )
    return str(path)


TIERS = ("smoke", "e2e", "distributed", "vllm", "slow")


def _launches_python(cmd) -> bool:
    argv = [cmd] if isinstance(cmd, (str, os.PathLike)) else list(cmd)
    if argv[1:3] == ["-I", "-S"]:  # the Python tool's child (common/sandbox.py): a bare interpreter, milliseconds
        return False
    words = " ".join(map(str, argv)).split()
    first = Path(words[0]).name if words else ""
    return first.startswith("python") or first in ("accelerate", "torchrun") or str(words[0]) == sys.executable


@pytest.fixture(autouse=True)
def _fast_tier_guard(request, monkeypatch):
    """An unmarked test may not launch a Python process (a script, a tool, a launcher): mark it (TIERS)."""
    if any(request.node.get_closest_marker(m) for m in TIERS):
        return
    real_init = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        if _launches_python(args):
            pytest.fail(
                f"{request.node.nodeid} launches {' '.join(map(str, args))[:120]!r} but carries no tier marker: "
                "mark it e2e (or distributed, vllm, slow), or test in-process"
            )
        return real_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


def run_script(script: str, *flags, env=None, timeout=600, check=True):
    """Run algos/<script> as a subprocess (as users do); returns the CompletedProcess."""
    cmd = [sys.executable, str(REPO / "algos" / script), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]


def only_run(output_dir) -> Path:
    runs = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]
