"""Environments (common/core/envs.py, common/integrations/sandbox.py): the Python tool's guarantees, tool-call parsing,
token in / token out over several turns (the trainer scores exactly the sampled ids), observation tokens out of every
loss, and failures of user environments bounded."""

import json
import os
import sys

import pytest

from shared_envs import REPO, _env_flags

sys.path.insert(0, str(REPO / "algos"))


@pytest.mark.vllm
def test_grpo_with_tools_on_vllm_with_lora_and_a_preset(tiny_agent, toy_prompts, tmp_path):
    """The vllm engine samples each turn from token ids (prompt + turns so far): the trainer's log-probs of the
    sampled tokens agree with vLLM's; LoRA and the environment's flags from a preset file."""
    from conftest import only_run, read_metrics, run_script

    preset = tmp_path / "agent.yaml"
    preset.write_text("env: tools\ntools: calculator\nmax_turns: 3\nlora_r: 8\nlearning_rate: 1.0e-3\n")
    flags = _env_flags(tiny_agent, toy_prompts, tmp_path / "out", "--config", preset, "--rollout-engine", "vllm",
                       "--num-prompts", 4, "--group-size", 2, "--mini-batch-size", 8, "--total-steps", 2)  # fmt: skip
    run_script("grpo_llm.py", *flags, env={"TOY_MODEL": tiny_agent})
    run = only_run(tmp_path / "out")
    rows = read_metrics(run)
    args = json.loads((run / "args.json").read_text())
    assert args["env"] == "tools" and args["lora_r"] == 8 and args["rollout_engine"] == "vllm"
    assert all(r["env/turns"] > 1 and r["env/tool_calls"] > 0 for r in rows)
    assert all(r["train/sampler_logprob_diff"] < 5e-3 for r in rows)  # vLLM's kernels vs the trainer's


@pytest.mark.distributed
@pytest.mark.vllm
def test_ppo_with_tools_on_vllm_under_ddp(tiny_agent, toy_prompts, tmp_path):
    """PPO, two processes, each with its own vLLM engine and its own trajectories; every env/* metric gathered from
    both (the same keys on each); the trainer's log-probs of the sampled turns agree with vLLM's."""
    import subprocess

    from conftest import accelerate_launch, only_run, read_metrics

    flags = _env_flags(tiny_agent, toy_prompts, tmp_path, "--env", "tools", "--tools", "calculator",
                       "--batch-size", 8, "--mini-batch-size", 8, "--total-steps", 2, "--rollout-engine", "vllm")  # fmt: skip
    cmd = [*accelerate_launch("cpu_2proc"), str(REPO / "algos/ppo_llm.py"), *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "TOY_MODEL": tiny_agent})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = only_run(tmp_path)
    assert json.loads((run / "args.json").read_text())["world_size"] == 2
    first = read_metrics(run)[0]  # (the policy learns to answer without the tool within a step or two at this lr)
    assert first["env/turns"] > 1 and first["env/tool_calls"] > 0 and first["perf/tool_s"] > 0
    assert first["train/sampler_logprob_diff"] < 5e-3
