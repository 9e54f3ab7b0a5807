"""What the tests of test_distributed.py share (tests/*/test_distributed.py: the tiers, and other test modules)."""

import atexit
import json
import shutil
import tempfile
from pathlib import Path

import torch

from conftest import REPO, launch_ranks, only_run, run_script

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def launch(script, *flags, env=None, config="cpu_2proc", processes=None):
    """`accelerate launch` of a script that must succeed (conftest.launch_ranks: its ranks forked warm)."""
    proc = launch_ranks(script, *flags, env=env, config=config, processes=processes)
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        # seen once in CI (1 of ~50 launches, a ZeRO-3 child, after its outputs were written; 4 of 4 reruns
        # passed): a C++ thread aborting the interpreter's exit. Rerun once; any other failure fails at once.
        proc = launch_ranks(script, *flags, env=env, config=config, processes=processes)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def assert_ran(run, kind):
    """Two processes really ran, under the engine asked for."""
    record = json.loads((run / "args.json").read_text())
    assert record["world_size"] == 2, record["world_size"]
    expected = {"DDP": "MULTI_CPU", "FSDP": "FSDP", "ZERO2": "DEEPSPEED", "ZERO3": "DEEPSPEED"}[kind]
    assert record["distributed_type"] == expected, record["distributed_type"]
    if kind.startswith("ZERO"):
        assert record["zero_stage"] == int(kind[-1]), record["zero_stage"]


_SHARED = Path(tempfile.mkdtemp(prefix="cleanrlhf_parity_"))  # this test process's reference runs (removed at exit)

atexit.register(shutil.rmtree, _SHARED, True)

_ONE_PROCESS: dict[tuple, Path] = {}


def equal_length_prompts(tmp_path=None):
    prompts = _SHARED / "same_len.jsonl"  # one path for every parity test: their reference runs are shared
    if not prompts.exists():
        with open(prompts, "w") as f:  # prompts of equal token length: identical padding on every process
            for ch in "abcdefgh":
                f.write(json.dumps({"prompt": f"say {ch}", "data_source": "toy"}) + "\n")
    return str(prompts)


def one_process_run(script, *flags, env=None) -> Path:
    """One process's run of `script` with `flags`: the reference a parity test compares with, run once per test
    process for every parity test with the same flags (DDP's and tensor parallelism's)."""

    key = (script, *map(str, flags), *sorted((env or {}).items()))
    if key not in _ONE_PROCESS:
        out = _SHARED / f"one_{len(_ONE_PROCESS)}"
        run_script(script, *flags, "--output-dir", out, env=env)
        _ONE_PROCESS[key] = only_run(out)
    return _ONE_PROCESS[key]


def grpo_one_update_flags(model):
    """One GRPO update with a (sharded) reference, evaluated before and after, on prompts of equal length, as the
    parity tests run it."""
    prompts = equal_length_prompts()
    return [
        "--model-name-or-path", model, "--train-files", prompts, "--val-files", prompts, "--num-eval-prompts", 4,
        "--reward-fn", TOY_REWARD, "--total-steps", 1, "--num-prompts", 2, "--group-size", 2,
        "--mini-batch-size", 4, "--micro-batch-size", 1, "--max-new-tokens", 6, "--learning-rate", 1e-3,
        "--kl-coef", 0.05, "--eval-every", 1,
    ]  # fmt: skip


def assert_same_update(a_dir, b_dir, base, rel=1e-4):
    """Two save_pretrained folders hold the same update of `base` (a state dict).

    Adam's first step moves every parameter by ~lr * g/|g|, so a parameter whose gradient is ~0 turns
    float-summation-order noise (1e-9: 2 processes add gradients in another order than 1) into a
    visible step; so the update is compared as a whole: the summed |difference| is under `rel` of the
    summed |update|, and fewer than `rel` of the parameters differ by more than 1e-4 (a tenth of one
    Adam step at lr 1e-3: ZeRO-3's partitioned reduction moved 3,710 embedding entries by up to 3.4e-5
    on one data order, all other parameters by under 1e-5).
    (Adam is blind to a global gradient scale: this checks the data each process used, the
    normalisations and the averaging.)"""
    from safetensors.torch import load_file

    a, b = load_file(Path(a_dir) / "model.safetensors"), load_file(Path(b_dir) / "model.safetensors")
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], base[k]) for k in a)  # the update did something
    diff = sum((a[k] - b[k]).abs().sum().item() for k in a)
    update = sum((a[k] - base[k]).abs().sum().item() for k in a)
    n_off = sum(((a[k] - b[k]).abs() > 1e-4).sum().item() for k in a)
    assert diff / update < rel and n_off < rel * sum(v.numel() for v in a.values()), (diff / update, n_off)


def base_weights(path, value=False):
    """The state dict a policy (or critic) built from `path` starts with, keyed as save_pretrained keys it."""
    from common.core import chat
    from common.core import models as M

    tok = chat.load_tokenizer(path)
    model = M.load_value_model(path, tok) if value else M.load_causal_lm(path, tok)
    return {k: v.clone() for k, v in model.state_dict().items()}


def ppo_one_update_flags(model, tmp_path=None):
    """One PPO update (policy and critic, whitened rewards) on prompts of equal length, evaluated before and after,
    as the parity tests run it."""
    return [
        "--model-name-or-path",
        model,
        "--train-files",
        equal_length_prompts(),
        "--val-files",
        equal_length_prompts(),
        "--num-eval-prompts",
        4,
        "--reward-fn",
        TOY_REWARD,
        "--total-steps",
        1,
        "--batch-size",
        4,
        "--mini-batch-size",
        4,
        "--micro-batch-size",
        1,
        "--whiten-rewards",
        "--max-new-tokens",
        6,
        "--learning-rate",
        1e-3,
        "--critic-learning-rate",
        1e-3,
        "--eval-every",
        1,
    ]
