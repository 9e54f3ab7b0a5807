"""One short run of every script, as a user launches it (`python algos/X.py`, the built-in default task (GRPO:
a toy task), a tiny model): exits 0, writes its run folder and metrics, saves a checkpoint whose model folders load with plain
transformers, and changed the trained weights. These are the fast tier's only process launches (CleanRL's
test per script); the longer runs (learning, resume, pipelines) are marked e2e."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, only_run, read_metrics, run_script

TOY_REWARD = f"{REPO}/tests/toy_reward.py:compute_score"

RL = ["--max-new-tokens", 6, "--num-eval-prompts", 4, "--learning-rate", 1e-3]
SCRIPTS = {
    "ppo_llm.py": (RL + ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 2], ["policy", "critic"]),
    "dynamic_kl_ppo.py": (RL + ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 2], ["policy"]),
    "grpo_llm.py": (
        RL + ["--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 2],
        ["policy"],
    ),
    "distill_llm.py": (RL + ["--num-prompts", 2, "--samples-per-prompt", 2, "--micro-batch-size", 2], ["policy"]),
    "dpo_llm.py": (
        [
            "--batch-size",
            4,
            "--micro-batch-size",
            2,
            "--num-eval-pairs",
            4,
            "--num-eval-prompts",
            4,
            "--max-new-tokens",
            6,
            "--learning-rate",
            1e-3,
        ],
        ["policy"],
    ),  # fmt: skip
    "sft_llm.py": (
        [
            "--batch-size",
            4,
            "--micro-batch-size",
            2,
            "--num-eval-examples",
            4,
            "--num-eval-prompts",
            4,
            "--max-new-tokens",
            6,
            "--learning-rate",
            1e-3,
        ],
        ["policy"],
    ),  # fmt: skip
    "rm_llm.py": (
        [
            "--batch-size",
            4,
            "--micro-batch-size",
            2,
            "--num-eval-pairs",
            4,
            "--num-norm-samples",
            4,
            "--learning-rate",
            1e-3,
        ],
        ["model"],
    ),  # fmt: skip
}


@pytest.mark.smoke
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_script_runs_two_steps(script, tiny, tiny_peaky, toy_prompts, tmp_path):
    flags, trained = SCRIPTS[script]
    env = {"TOY_MODEL": tiny_peaky}  # the toy reward's tokenizer
    if script == "grpo_llm.py":  # a random model scores 0 on every default-task group: no advantage, no update
        tiny, flags = (
            tiny_peaky,
            flags + ["--train-files", toy_prompts, "--val-files", toy_prompts, "--reward-fn", TOY_REWARD],
        )
    if script == "distill_llm.py":  # the student (tiny) learns toward another model of its tokenizer
        flags = flags + ["--teacher", tiny_peaky]
    proc = run_script(
        script,
        "--model-name-or-path",
        tiny,
        "--total-steps",
        2,
        "--eval-every",
        2,
        "--output-dir",
        tmp_path,
        *flags,
        env=env,
    )
    run = only_run(tmp_path)
    # a quiet start: no library noise before (or among) our lines (bitsandbytes' kernel warning, DeepSpeed's
    # accelerator line, transformers' progress bars)
    for noise in ("kernels-community", "Setting accelerator", "Loading weights", "Traceback"):
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stderr[-2000:])
    assert json.loads((run / "args.json").read_text())["total_steps"] == 2
    rows = read_metrics(run)
    assert {1, 2} <= {r["step"] for r in rows}, rows
    assert any(k.startswith("eval/") for r in rows if r["step"] == 2 for k in r), rows[-1].keys()
    ckpt = run / "checkpoints" / "step_2"
    assert (ckpt / "trainer_state.pt").exists()
    base = load_file(Path(tiny) / "model.safetensors")
    for name in trained:
        saved = load_file(ckpt / name / "model.safetensors")
        changed = [k for k in base if k in saved and not torch.equal(base[k], saved[k])]
        assert changed, f"{script}: {name} saved unchanged weights"
    from transformers import AutoConfig

    AutoConfig.from_pretrained(ckpt / trained[0])
