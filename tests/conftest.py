"""Shared fixtures: tiny random models saved to folders and loaded through the users' code path."""

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
