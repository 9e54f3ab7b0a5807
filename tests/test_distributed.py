"""Two CPU processes over gloo through `accelerate launch` (configs/accelerate/cpu_2proc.yaml)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, only_run, read_metrics

TOY_REWARD = f"{REPO}/tests/toy_reward.py:compute_score"


def launch(script, *flags, env=None):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
           str(REPO / "algos" / script), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("script,sizes", [
    ("ppo_llm.py", ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1]),
    ("grpo_llm.py", ["--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 1]),
    ("dynamic_kl_ppo.py", ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1]),
])
def test_two_processes(script, sizes, tiny_peaky, toy_prompts, tmp_path):
    launch(script, "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--val-files", toy_prompts,
           "--reward-fn", TOY_REWARD, "--output-dir", tmp_path, "--total-steps", 2, "--eval-every", 2,
           "--num-eval-prompts", 4, "--max-new-tokens", 6, "--learning-rate", 1e-3, *sizes, env={"TOY_MODEL": tiny_peaky})
    run = only_run(tmp_path)  # one run folder, written by the main process only
    assert json.loads((run / "args.json").read_text())["world_size"] == 2  # two processes really ran
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1]
    assert (run / "checkpoints" / "step_2" / "policy" / "model.safetensors").exists()


@pytest.mark.parametrize("script,flags", [
    ("dpo_llm.py", ["--batch-size", 4, "--micro-batch-size", 2, "--num-eval-pairs", 4, "--num-eval-prompts", 4, "--max-new-tokens", 4]),
    ("sft_llm.py", ["--batch-size", 4, "--micro-batch-size", 2, "--num-eval-examples", 4, "--num-eval-prompts", 4, "--max-new-tokens", 4]),
    ("rm_llm.py", ["--batch-size", 4, "--micro-batch-size", 2, "--num-eval-pairs", 4, "--num-norm-samples", 8]),
])
def test_two_processes_offline_scripts(script, flags, tiny, tmp_path):
    """DPO, SFT and RM on their built-in data under 2 processes."""
    launch(script, "--model-name-or-path", tiny, "--output-dir", tmp_path, "--total-steps", 2, "--eval-every", 2, *flags)
    run = only_run(tmp_path)
    assert json.loads((run / "args.json").read_text())["world_size"] == 2
    rows = read_metrics(run)
    assert rows[0]["step"] == 0 and any(r["step"] == 2 for r in rows)


def test_batch_not_divisible_by_processes_names_the_flag(tiny, tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
           str(REPO / "algos/ppo_llm.py"), "--model-name-or-path", tiny, "--output-dir", str(tmp_path),
           "--batch-size", "3", "--mini-batch-size", "3", "--micro-batch-size", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--batch-size over the number of processes: 3 is not divisible by 2" in proc.stderr


def test_ddp_update_equals_single_process_update(tiny_peaky, tmp_path):
    """Same global batch, one GRPO update: 2 processes (DDP over gloo) end with the parameters of 1 process."""
    import torch
    from safetensors.torch import load_file

    prompts = tmp_path / "same_len.jsonl"
    with open(prompts, "w") as f:  # prompts of equal token length: identical padding on every process
        for ch in "abcdefgh":
            f.write(json.dumps({"prompt": f"say {ch}", "data_source": "toy"}) + "\n")
    flags = ["--model-name-or-path", tiny_peaky, "--train-files", str(prompts), "--reward-fn", TOY_REWARD,
             "--total-steps", 1, "--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 1,
             "--max-new-tokens", 6, "--learning-rate", 1e-3, "--eval-every", 0]
    env = {"TOY_MODEL": tiny_peaky}
    from conftest import run_script

    run_script("grpo_llm.py", *flags, "--output-dir", tmp_path / "one", env=env)
    launch("grpo_llm.py", *flags, "--output-dir", tmp_path / "two", env=env)
    one = only_run(tmp_path / "one")
    two = only_run(tmp_path / "two")
    assert json.loads((two / "args.json").read_text())["world_size"] == 2
    assert read_metrics(one)[-1]["train/reward"] == pytest.approx(read_metrics(two)[-1]["train/reward"], abs=1e-6)
    a = load_file(one / "checkpoints/step_1/policy/model.safetensors")
    b = load_file(two / "checkpoints/step_1/policy/model.safetensors")
    base = load_file(f"{tiny_peaky}/model.safetensors")
    assert any(not torch.equal(a[k], base[k]) for k in a)  # the update did something
    # Adam's first step moves every parameter by ~lr * g/|g|, so a parameter whose gradient is ~0 turns
    # float-summation-order noise (1e-9) into a visible step; compare the update as a whole instead:
    # here 17 of 3.2M parameters differ by more than 1e-6 and the total difference is 1e-6 of the update.
    # (Adam is blind to a global gradient scale: this checks the data each process used and the averaging.)
    diff = sum((a[k] - b[k]).abs().sum().item() for k in a)
    update = sum((a[k] - base[k]).abs().sum().item() for k in a)
    n_off = sum(((a[k] - b[k]).abs() > 1e-6).sum().item() for k in a)
    assert diff / update < 1e-4 and n_off < 1e-4 * sum(v.numel() for v in a.values()), (diff / update, n_off)


def test_accelerate_configs_are_consistent():
    import yaml

    for path in sorted((REPO / "configs" / "accelerate").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED"), path
        assert cfg["num_processes"] % cfg["num_machines"] == 0, path
        pc = cfg.get("parallelism_config")
        if pc:
            prod = pc["parallelism_config_dp_replicate_size"] * pc["parallelism_config_dp_shard_size"] * \
                pc["parallelism_config_tp_size"] * pc["parallelism_config_cp_size"]
            assert prod == cfg["num_processes"], path


def test_generation_from_fsdp2_sharded_model(tiny):
    """torch's fully_shard (what Accelerate's FSDP2 uses on GPUs) over gloo: unshard once, generate, reshard."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "fsdp2_generate_check.py"), tiny]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("FSDP2 generation OK") == 2
