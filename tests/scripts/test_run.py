"""Run plumbing: config presets, run folder, checkpoints (atomic, resumable), RNG state round trip."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from common.harness import checkpoint as C
from common.harness import tracking

TOY_LOOP = textwrap.dedent('''
    """A toy training loop: a tiny model trained with AdamW on random data drawn from the global RNG,
    checkpointed with common.harness.checkpoint; used to test exact resume and crash safety."""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import torch
    from accelerate import Accelerator
    from transformers import LlamaConfig, LlamaForCausalLM
    from common import checkpoint as C
    from common import errors as E

    out, total, stop_at, resume = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    slow_save = len(sys.argv) > 5
    acc = Accelerator(cpu=True)
    from common.core.seeds import seed_everything

    seed_everything(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    start = 0
    if resume != "-":
        ckpt = C.resolve_checkpoint(resume)
        C.load_weights(model, ckpt / "model")
        st = C.load_trainer_state(ckpt)
        opt.load_state_dict(st["opt"]); sched.load_state_dict(st["sched"]); C.set_rng_state(st["rng"]); start = st["step"]
    model, opt = acc.prepare(model, opt)
    for step in range(start + 1, total + 1):
        ids = torch.randint(0, 64, (4, 8))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); sched.step(); opt.zero_grad()
        if slow_save and step == stop_at:
            orig = torch.save
            def slow(obj, path, *a, **k):
                print("SAVING", flush=True); time.sleep(30); orig(obj, path, *a, **k)
            torch.save = slow
        C.save_checkpoint(acc, out, step, {{"model": model}}, {{"opt": opt.state_dict(), "sched": sched.state_dict()}})
        if step == stop_at:
            break
    torch.save({{k: v.detach().clone() for k, v in model.state_dict().items()}}, out / "final.pt")
''')


def _toy(tmp_path, *args):
    script = tmp_path / "toy_loop.py"
    script.write_text(TOY_LOOP.format(repo=str(tracking.REPO)))
    return [sys.executable, str(script), *map(str, args)]


@pytest.mark.e2e
def test_resume_is_bit_identical(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    subprocess.run(_toy(tmp_path, straight, 6, 0, "-"), check=True, capture_output=True)
    subprocess.run(_toy(tmp_path, split, 6, 3, "-"), check=True, capture_output=True)
    subprocess.run(_toy(tmp_path, split, 6, 0, split), check=True, capture_output=True)  # run folder -> latest (step 3)
    a, b = torch.load(straight / "final.pt"), torch.load(split / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in C.list_checkpoints(split)) == [f"step_{i}" for i in range(1, 7)]


@pytest.mark.e2e
def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    out = tmp_path / "crash"
    proc = subprocess.Popen(_toy(tmp_path, out, 5, 3, "-", "slow"), stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until step 3's save is in progress
        if "SAVING" in line:
            break
    time.sleep(1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert "step_3" not in names and any(n.startswith(".step_3.tmp-") for n in names)  # half-written: temp name only
    latest = C.resolve_checkpoint(str(out))
    assert latest.name == "step_2"
    st = C.load_trainer_state(latest)
    assert st["step"] == 2
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(latest / "model")  # loads with plain transformers


@pytest.mark.e2e
def test_sharded_critic_and_reward_model_folders_load_as_what_they_are(tiny, toy_prompts, tmp_path, monkeypatch):
    """--checkpoint-format sharded writes each model's config without its weights; the config names the class that
    loads it (as save_pretrained does), so a PPO checkpoint's critic folder converts to a critic (its trained head,
    not a causal LM's), loads as --critic-model and exports, and an rm_llm.py checkpoint's folder serves as
    --reward-model (the audit: `Missing key ... lm_head.weight` for both)."""
    from common.core import models as M
    from conftest import REPO, only_run, run_script, run_tool

    monkeypatch.setenv("CLEANRLHF_CACHE", str(tmp_path / "cache"))
    env = {"CLEANRLHF_CACHE": str(tmp_path / "cache"), "TOY_MODEL": tiny}
    toy = [f"{REPO}/tests/helpers/toy_reward.py:compute_score"]
    common = ["--model-name-or-path", tiny, "--train-files", toy_prompts, "--max-new-tokens", 4, "--eval-every", 0,
              "--checkpoint-format", "sharded", "--total-steps", 1]  # fmt: skip
    run_script("ppo_llm.py", *common, "--reward-fn", *toy, "--batch-size", 4, "--mini-batch-size", 4,
               "--micro-batch-size", 2, "--output-dir", tmp_path / "ppo", env=env)  # fmt: skip
    ckpt = only_run(tmp_path / "ppo") / "checkpoints" / "step_1"
    assert json.loads((ckpt / "critic" / "config.json").read_text())["architectures"][0].endswith("TokenClassification")
    critic = M.load_value_model(str(ckpt / "critic"))
    assert critic.score.weight.abs().sum() > 0  # the trained head (a fresh critic's starts at zero)
    run_tool("tools.export", ckpt, "--model", "critic", "--out", tmp_path / "exported", env=env)
    exported = M.load_value_model(str(tmp_path / "exported"))
    assert torch.equal(exported.score.weight, critic.score.weight)
    run_script("ppo_llm.py", *common, "--reward-fn", *toy, "--batch-size", 4, "--mini-batch-size", 4,
               "--micro-batch-size", 2, "--critic-model", ckpt / "critic", "--output-dir", tmp_path / "ppo2", env=env)  # fmt: skip

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(8))
    )
    run_script("rm_llm.py", "--model-name-or-path", tiny, "--train-files", pairs, "--val-files", pairs, "--batch-size",
               4, "--micro-batch-size", 2, "--num-eval-pairs", 4, "--num-norm-samples", 4, "--total-steps", 1,
               "--checkpoint-format", "sharded", "--output-dir", tmp_path / "rm", env=env)  # fmt: skip
    (rm_folder,) = [
        p for p in (only_run(tmp_path / "rm") / "checkpoints" / "step_1").iterdir() if (p / "config.json").is_file()
    ]
    run_script("grpo_llm.py", "--model-name-or-path", tiny, "--train-files", toy_prompts, "--max-new-tokens", 4,
               "--eval-every", 0, "--total-steps", 1, "--reward", "model:1", "--reward-model", rm_folder,
               "--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 2, "--output-dir", tmp_path / "grpo", env=env)  # fmt: skip
