"""Two CPU processes over gloo through `accelerate launch`: DDP (configs/accelerate/cpu_2proc.yaml),
FSDP2 (cpu_2proc_fsdp2.yaml: Accelerate's fully_shard path, switched on for CPU processes by
common.parallel.accelerator.make_accelerator) and DeepSpeed ZeRO-2/3 (cpu_2proc_zero{2,3}.yaml: DeepSpeed's
CPU accelerator over gloo)."""

import atexit
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, accelerate_launch, launch_ranks, only_run, read_metrics, run_script
from shared_distributed import (
    _SHARED,
    TOY_REWARD,
    assert_ran,
    assert_same_update,
    base_weights,
    grpo_one_update_flags,
    launch,
    one_process_run,
    ppo_one_update_flags,
)

CONFIGS = {"DDP": "cpu_2proc", "FSDP": "cpu_2proc_fsdp2", "ZERO2": "cpu_2proc_zero2", "ZERO3": "cpu_2proc_zero3"}

RUN_ALL_SCRIPTS = ("DDP", "FSDP", "ZERO3")  # every script under these; ZeRO-2 in the parity test

ONLINE_SIZES = {
    "ppo_llm.py": ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1],
    "grpo_llm.py": ["--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 1],
    "dynamic_kl_ppo.py": ["--batch-size", 4, "--mini-batch-size", 4, "--micro-batch-size", 1],
    "distill_llm.py": ["--num-prompts", 2, "--samples-per-prompt", 2, "--micro-batch-size", 1],
}

OFFLINE_FLAGS = [
    (
        "dpo_llm.py",
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
            4,
        ],
    ),
    (
        "sft_llm.py",
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
            4,
        ],
    ),
    ("rm_llm.py", ["--batch-size", 4, "--micro-batch-size", 2, "--num-eval-pairs", 4, "--num-norm-samples", 8]),
]

atexit.register(shutil.rmtree, _SHARED, True)


def ppo_parity_flags(model, prompts):
    """PPO (policy, critic, reference: --kl-coef) for 2 iterations of 2 epochs x 2 minibatches x 2 micro-batches,
    as the engine parity tests run it under each engine."""
    return [
        "--model-name-or-path", model, "--train-files", prompts, "--reward-fn", TOY_REWARD, "--batch-size", 4,
        "--mini-batch-size", 2, "--micro-batch-size", 1, "--update-epochs", 2, "--max-new-tokens", 6,
        "--learning-rate", 1e-3, "--critic-learning-rate", 1e-3, "--eval-every", 0, "--kl-coef", 0.1,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ppo_ddp_run(tiny_peaky, toy_prompts, tmp_path_factory):
    """The DDP run every engine's parity test compares with (one launch for the module)."""
    out = tmp_path_factory.mktemp("ppo_ddp")
    launch("ppo_llm.py", *ppo_parity_flags(tiny_peaky, toy_prompts), "--total-steps", 2, "--output-dir", out,
           env={"TOY_MODEL": tiny_peaky})  # fmt: skip
    return only_run(out)


def resume_copy(run, step, tmp_path):
    """A copy of `run` (its folder) without its checkpoints after `step`, to resume from its step-`step` checkpoint
    (the resume drops its rows after `step` and must write the later checkpoints again): (the copy, the checkpoint)."""
    copy = tmp_path / "half" / run.name
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.split("_")[1]) > step:
            shutil.rmtree(later)
    return copy, copy / f"checkpoints/step_{step}"


def assert_resumed(run):
    """`run` was resumed (args.json records it) and holds the final checkpoint the resume wrote."""
    assert json.loads((run / "args.json").read_text())["resumes"], run
    assert (run / "checkpoints/step_2").is_dir()


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ppo_llm.py under DDP, FSDP2 and ZeRO-3 runs (longer) in the parity tests below, so not here again, nor GRPO under
# DDP (its parity test: with evaluation and a checkpoint); dynamic_kl_ppo.py is ppo_llm.py plus a no-grad forward
# (the same call as the rollout's), so under DDP only; distillation with its teacher sharded (suite time)
@pytest.mark.distributed
@pytest.mark.parametrize(
    "script,sizes,kind",
    [(s, sizes, k) for s, sizes in ONLINE_SIZES.items() for k in RUN_ALL_SCRIPTS
     if s == "grpo_llm.py" and k != "DDP" or (s, k) in (("dynamic_kl_ppo.py", "DDP"), ("distill_llm.py", "FSDP"))],
)  # fmt: skip
def test_two_processes(script, sizes, kind, tiny, tiny_peaky, toy_prompts, tmp_path):
    if script == "distill_llm.py":  # a student (tiny_peaky) and a teacher of its tokenizer (tiny)
        sizes = sizes + ["--teacher", tiny]
    launch(
        script,
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--val-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        tmp_path,
        "--total-steps",
        2,
        "--eval-every",
        2,
        "--num-eval-prompts",
        4,
        "--max-new-tokens",
        6,
        "--learning-rate",
        1e-3,
        *sizes,
        env={"TOY_MODEL": tiny_peaky},
        config=CONFIGS[kind],
    )
    run = only_run(tmp_path)  # one run folder, written by the main process only
    assert_ran(run, kind)
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/accuracy" in rows[-1]
    assert (run / "checkpoints" / "step_2" / "policy" / "model.safetensors").exists()


# SFT and RM under DDP are the plain path (suite time): DPO under all three, SFT and RM sharded (SFT under FSDP2,
# with its evaluation: in the sharded-checkpoint test below)
@pytest.mark.distributed
@pytest.mark.parametrize(
    "script,flags,kind",
    [(s, f, k) for s, f in OFFLINE_FLAGS for k in RUN_ALL_SCRIPTS
     if s == "dpo_llm.py" or k != "DDP" and (s, k) != ("sft_llm.py", "FSDP")],
)  # fmt: skip
def test_two_processes_offline_scripts(script, flags, kind, tiny, tmp_path):
    """DPO, SFT and RM on their built-in data under 2 processes."""
    launch(
        script,
        "--model-name-or-path",
        tiny,
        "--output-dir",
        tmp_path,
        "--total-steps",
        2,
        "--eval-every",
        2,
        *flags,
        config=CONFIGS[kind],
    )
    run = only_run(tmp_path)
    assert_ran(run, kind)
    rows = read_metrics(run)
    assert rows[0]["step"] == 0 and any(r["step"] == 2 for r in rows)


@pytest.mark.distributed
def test_batch_not_divisible_by_processes_names_the_flag(tiny, tmp_path):
    flags = ["--model-name-or-path", tiny, "--output-dir", tmp_path, "--batch-size", 3, "--mini-batch-size", 3,
             "--micro-batch-size", 1]  # fmt: skip
    proc = launch_ranks("ppo_llm.py", *flags)
    assert proc.returncode != 0 and "--batch-size over the number of processes: 3 is not divisible by 2" in proc.stderr


@pytest.mark.parity  # its one-process reference run is shared (one_process_run)
@pytest.mark.distributed
def test_grpo_ddp_update_equals_single_process_update(tiny_peaky, tmp_path):
    """Same global batch, one GRPO update (token-mean over the global minibatch): 2 processes (DDP over
    gloo) end with the parameters of 1 process; both evaluate (split over the ranks) to the same accuracy."""
    flags, env = grpo_one_update_flags(tiny_peaky), {"TOY_MODEL": tiny_peaky}
    one = one_process_run("grpo_llm.py", *flags, env=env)
    launch("grpo_llm.py", *flags, "--output-dir", tmp_path / "two", env=env)
    two = only_run(tmp_path / "two")
    assert_ran(two, "DDP")
    rows1, rows2 = read_metrics(one), read_metrics(two)
    assert [r["step"] for r in rows2] == [0, 1] and "eval/accuracy" in rows2[-1]
    for key in ("train/reward", "train/kl", "loss/policy"):
        assert rows1[-1][key] == pytest.approx(rows2[-1][key], rel=1e-4, abs=1e-6), key
    assert [r["eval/accuracy"] for r in rows1] == pytest.approx([r["eval/accuracy"] for r in rows2])
    assert_same_update(one / "checkpoints/step_1/policy", two / "checkpoints/step_1/policy", base_weights(tiny_peaky))


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["DDP", "FSDP"])
def test_grpo_with_shared_prompts_and_the_chunked_head_makes_the_update_of_neither(tiny_peaky, tmp_path, kind):
    """2 processes, float32, a group's two rows in one micro-batch, packed into one sequence (its prompt once) and,
    under DDP, the LM head in chunks from the hidden states (FSDP2 shards the head: the full logits there) (issue 52):
    the same update as both levers off (--no-share-prompts, CLEANRLHF_LM_HEAD=full)."""
    flags = [*grpo_one_update_flags(tiny_peaky), "--micro-batch-size", 2, "--mixed-precision", "no", "--eval-every", 0]
    env = {"TOY_MODEL": tiny_peaky}
    launch("grpo_llm.py", *flags, "--output-dir", tmp_path / "on", env=env, config=CONFIGS[kind])
    launch("grpo_llm.py", *flags, "--no-share-prompts", "--output-dir", tmp_path / "off",
           env={**env, "CLEANRLHF_LM_HEAD": "full"}, config=CONFIGS[kind])  # fmt: skip
    on, off = only_run(tmp_path / "on"), only_run(tmp_path / "off")
    assert_ran(on, kind)
    (a,), (b,) = read_metrics(on), read_metrics(off)
    for key in ("train/reward", "train/kl", "loss/policy", "train/entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    assert_same_update(on / "checkpoints/step_1/policy", off / "checkpoints/step_1/policy", base_weights(tiny_peaky))


@pytest.mark.parity  # its one-process reference run is shared (one_process_run)
@pytest.mark.distributed
def test_ppo_ddp_update_equals_single_process_update(tiny_peaky, tmp_path):
    """One PPO update of policy and critic with advantages whitened over the global batch and the
    token-mean over the global minibatch: 2 processes end where 1 process does. With per-rank
    whitening (each rank's own mean and std) this fails."""
    flags, env = ppo_one_update_flags(tiny_peaky), {"TOY_MODEL": tiny_peaky}
    one = one_process_run("ppo_llm.py", *flags, env=env)
    launch("ppo_llm.py", *flags, "--output-dir", tmp_path / "two", env=env)
    two = only_run(tmp_path / "two")
    assert_ran(two, "DDP")
    assert [r["step"] for r in read_metrics(two)] == [0, 1] and "eval/accuracy" in read_metrics(two)[-1]
    assert [r["eval/accuracy"] for r in read_metrics(one)] == [r["eval/accuracy"] for r in read_metrics(two)]
    m1, m2 = read_metrics(one)[-1], read_metrics(two)[-1]
    for key in ("train/reward", "train/kl", "train/value_mean", "loss/policy", "loss/value", "train/entropy"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    assert_same_update(one / "checkpoints/step_1/policy", two / "checkpoints/step_1/policy", base_weights(tiny_peaky))
    assert_same_update(
        one / "checkpoints/step_1/critic", two / "checkpoints/step_1/critic", base_weights(tiny_peaky, value=True)
    )


@pytest.mark.distributed
def test_fsdp2_equals_ddp_and_resumes(ppo_ddp_run, tiny_peaky, toy_prompts, tmp_path):
    """PPO (policy, critic, reference) for 2 iterations under FSDP2 (fully_shard, DTensor parameters and
    optimizer states) ends with the parameters of the DDP run; and its step-1 checkpoint resumed for step 2 equals
    2 straight (optimizer states gathered to a full checkpoint and re-sharded)."""
    flags = ppo_parity_flags(tiny_peaky, toy_prompts)
    env = {"TOY_MODEL": tiny_peaky}
    launch("ppo_llm.py", *flags, "--total-steps", 2, "--save-every", 1, "--output-dir", tmp_path / "fsdp", env=env,
           config="cpu_2proc_fsdp2")  # fmt: skip
    resumed, ckpt = resume_copy(only_run(tmp_path / "fsdp"), 1, tmp_path)
    launch("ppo_llm.py", *flags, "--total-steps", 2, "--output-dir", tmp_path / "half", "--resume", ckpt, env=env,
           config="cpu_2proc_fsdp2")  # fmt: skip
    ddp, fsdp = ppo_ddp_run, only_run(tmp_path / "fsdp")
    assert_ran(ddp, "DDP"), assert_ran(fsdp, "FSDP"), assert_ran(resumed, "FSDP"), assert_resumed(resumed)
    for name, value in (("policy", False), ("critic", True)):
        base = base_weights(tiny_peaky, value)
        assert_same_update(ddp / f"checkpoints/step_2/{name}", fsdp / f"checkpoints/step_2/{name}", base)
        assert_same_update(fsdp / f"checkpoints/step_2/{name}", resumed / f"checkpoints/step_2/{name}", base)
    no_perf = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    straight = no_perf(read_metrics(fsdp))
    assert [r["step"] for r in straight] == [1, 2] and straight[-1]["train/kl"] > 0  # the policy moved
    for a, b in zip(no_perf(read_metrics(resumed)), straight, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    for a, b in zip(no_perf(read_metrics(ddp)), straight, strict=True):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-5)


@pytest.mark.distributed
def test_distributed_statistics():
    """masked mean/var/whiten and batch-scaled group advantages with distributed=True over 2 gloo ranks
    holding uneven slices equal numpy over the whole batch."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "helpers" / "dist_ops_check.py"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("distributed stats OK") == 2


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_fsdp2_weight_stream_equals_unsharded(tiny, kind):
    """Accelerate's FSDP2 over 2 gloo processes: the engine's weights streamed one tensor at a time from the shards
    equal the unsharded model's (LoRA merged), the fingerprint agrees across ranks, and the prepared model reduces
    in float32 (tests/helpers/fsdp2_stream_check.py)."""
    cmd = [*accelerate_launch("cpu_2proc_fsdp2"), str(REPO / "tests" / "helpers" / "fsdp2_stream_check.py"), tiny, kind]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("FSDP2 stream OK") == 2


@pytest.mark.distributed
def test_generation_from_fsdp2_sharded_model(tiny):
    """torch's fully_shard (what Accelerate's FSDP2 uses on GPUs) over gloo: unshard once, generate, reshard."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "tests" / "helpers" / "fsdp2_generate_check.py"),
        tiny,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("FSDP2 generation OK") == 2


@pytest.mark.distributed
def test_zero3_generation_runs_no_module_hook(tiny):
    """ZeRO-3's per-module hooks are off for the rollout (DeepSpeed keeps them on inside GatheredParameters: every
    decoding step ran them for every module) and back for the training step (tests/helpers/zero3_generate_check.py)."""
    cmd = [*accelerate_launch("cpu_2proc_zero3"), str(REPO / "tests" / "helpers" / "zero3_generate_check.py"), tiny]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ZeRO-3 generation OK") == 2, proc.stdout[-2000:]


@pytest.mark.distributed
def test_deepspeed_equals_ddp_and_resumes(ppo_ddp_run, tiny_peaky, toy_prompts, tmp_path):
    """PPO (policy, critic, ZeRO-3-partitioned reference) under ZeRO-2 and ZeRO-3 ends with the parameters and
    metrics of the DDP run (the engines step at the minibatch boundary, with the scripts' loss scaling); ZeRO-3's
    step-1 checkpoint resumed for step 2 equals 2 straight; a DeepSpeed checkpoint resumed under DDP stops with a
    clear message; a pickle planted in an engine file never runs."""
    flags = ppo_parity_flags(tiny_peaky, toy_prompts)
    env = {"TOY_MODEL": tiny_peaky}
    for kind in ("ZERO2", "ZERO3"):
        save = ["--save-every", 1] if kind == "ZERO3" else []  # its step-1 checkpoint is resumed below
        launch("ppo_llm.py", *flags, *save, "--total-steps", 2, "--output-dir", tmp_path / kind, env=env,
               config=CONFIGS[kind])  # fmt: skip
    runs = {"DDP": ppo_ddp_run, **{kind: only_run(tmp_path / kind) for kind in ("ZERO2", "ZERO3")}}
    half, ckpt = resume_copy(runs["ZERO3"], 1, tmp_path)  # a copy of the ZeRO-3 run, resumed from step 1
    launch("ppo_llm.py", *flags, "--total-steps", 2, "--output-dir", tmp_path / "half", "--resume", ckpt, env=env,
           config=CONFIGS["ZERO3"])  # fmt: skip
    for kind, run in runs.items():
        assert_ran(run, kind)
    resumed = half  # a resume continues its own run folder
    assert_resumed(resumed)
    assert (half / "checkpoints/step_1/policy/deepspeed/state").is_dir()  # DeepSpeed's own per-rank files
    no_perf = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    ddp = no_perf(read_metrics(runs["DDP"]))
    assert ddp[-1]["train/kl"] > 0  # the policy moved
    for kind in ("ZERO2", "ZERO3"):
        for a, b in zip(no_perf(read_metrics(runs[kind])), ddp, strict=True):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-6), kind
    for a, b in zip(no_perf(read_metrics(resumed)), no_perf(read_metrics(runs["ZERO3"])), strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-8)
    for name, value in (("policy", False), ("critic", True)):
        base = base_weights(tiny_peaky, value)
        for kind in ("ZERO2", "ZERO3"):
            assert_same_update(
                runs["DDP"] / f"checkpoints/step_2/{name}", runs[kind] / f"checkpoints/step_2/{name}", base
            )
        assert_same_update(
            runs["ZERO3"] / f"checkpoints/step_2/{name}", resumed / f"checkpoints/step_2/{name}", base, rel=1e-6
        )
    cmd = [
        *accelerate_launch("cpu_2proc"),
        str(REPO / "algos/ppo_llm.py"),
        *map(str, flags),
        "--total-steps",
        "3",
        "--output-dir",
        str(tmp_path / "wrong"),
        "--resume",
        str(half),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode != 0 and "written under DeepSpeed" in proc.stderr
    # a pickle payload planted in a DeepSpeed engine file (DeepSpeed loads them with weights_only=False) never runs

    marker = tmp_path / "PWNED"
    engine_file = next((half / "checkpoints/step_2/policy/deepspeed/state").glob("zero_pp_rank_0_*optim_states.pt"))
    state = torch.load(engine_file, weights_only=False)
    state["planted"] = Payload(str(marker))
    torch.save(state, engine_file)
    cmd = [
        *accelerate_launch(CONFIGS["ZERO3"]),
        str(REPO / "algos/ppo_llm.py"),
        *map(str, flags),
        "--total-steps",
        "3",
        "--resume",
        str(half),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode != 0 and "which loading would execute" in proc.stderr and not marker.exists(), proc.stderr[
        -2000:
    ]


@pytest.mark.distributed
def test_online_dpo_two_processes_with_uneven_pairs(tiny_peaky, toy_prompts, tmp_path):
    """--online skips tied groups, so the 2 ranks hold different numbers of pairs (0 to 2 each): every
    rank still runs the same number of backward passes (a weight-0 filler), so DDP does not hang, and
    both ranks step together."""
    launch(
        "dpo_llm.py",
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--online",
        "--reward-fn",
        TOY_REWARD,
        "--output-dir",
        tmp_path,
        "--total-steps",
        4,
        "--batch-size",
        4,
        "--micro-batch-size",
        1,
        "--group-size",
        2,
        "--max-new-tokens",
        5,
        "--eval-every",
        0,
        "--learning-rate",
        1e-3,
        env={"TOY_MODEL": tiny_peaky},
    )
    run = only_run(tmp_path)
    assert_ran(run, "DDP")
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r["train/pairs"] for r in rows) + sum(r["train/skipped_ties"] for r in rows) == 16
    assert any(r["train/pairs"] in (1, 3) for r in rows), rows  # an odd total: the two ranks held different counts


@pytest.mark.distributed
def test_lora_under_fsdp2_and_zero3_equals_ddp(tiny_peaky, toy_prompts, tmp_path):
    """GRPO with LoRA (reference = adapter disabled) for 2 iterations: the adapters saved under FSDP2 and
    ZeRO-3 equal the DDP ones. (Under FSDP2 a peft model generates through its base model, below the
    FSDP root; unwrap_for_generation initialises FSDP from the root first.)"""
    from safetensors.torch import load_file

    flags = [
        "--model-name-or-path",
        tiny_peaky,
        "--train-files",
        toy_prompts,
        "--reward-fn",
        TOY_REWARD,
        "--total-steps",
        2,
        "--eval-every",
        0,
        "--max-new-tokens",
        6,
        "--learning-rate",
        1e-2,
        "--lora-r",
        4,
        "--kl-coef",
        0.05,
        "--num-prompts",
        2,
        "--group-size",
        2,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        1,
    ]
    for kind in ("DDP", "FSDP", "ZERO3"):
        launch(
            "grpo_llm.py", *flags, "--output-dir", tmp_path / kind, env={"TOY_MODEL": tiny_peaky}, config=CONFIGS[kind]
        )
    runs = {kind: only_run(tmp_path / kind) for kind in ("DDP", "FSDP", "ZERO3")}
    adapters = {k: load_file(r / "checkpoints/step_2/policy/adapter_model.safetensors") for k, r in runs.items()}
    ddp = adapters["DDP"]
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in ddp.items())  # B starts at 0: it trained
    for kind in ("FSDP", "ZERO3"):
        assert_ran(runs[kind], kind)
        assert adapters[kind].keys() == ddp.keys()
        diff = sum((adapters[kind][k] - ddp[k]).abs().sum().item() for k in ddp)
        assert diff / sum(v.abs().sum().item() for v in ddp.values()) < 1e-5, (kind, diff)


@pytest.mark.distributed
def test_lora_reward_model_export_under_sharding(tiny, tmp_path):
    """rm_llm.py --lora-r exports a merged plain reward model; under FSDP2 and ZeRO-3 the model is sharded,
    so the merge runs on the gathered state dict (merging modules in place wrote empty (0,) tensors under
    ZeRO-3). The three exports are equal and full-size."""
    from safetensors.torch import load_file

    flags = [
        "--model-name-or-path",
        tiny,
        "--total-steps",
        2,
        "--eval-every",
        2,
        "--batch-size",
        4,
        "--micro-batch-size",
        2,
        "--num-eval-pairs",
        4,
        "--num-norm-samples",
        8,
        "--lora-r",
        4,
        "--learning-rate",
        1e-2,
    ]
    for kind in ("DDP", "FSDP", "ZERO3"):
        launch("rm_llm.py", *flags, "--output-dir", tmp_path / kind, config=CONFIGS[kind])
    exports = {
        k: load_file(only_run(tmp_path / k) / "reward_model/model.safetensors") for k in ("DDP", "FSDP", "ZERO3")
    }
    ddp = exports["DDP"]
    assert ddp["model.embed_tokens.weight"].shape[0] > 0 and not any("lora" in k for k in ddp)
    for kind in ("FSDP", "ZERO3"):
        assert exports[kind].keys() == ddp.keys()
        for k in ddp:
            torch.testing.assert_close(exports[kind][k], ddp[k], rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_sharded_checkpoint_resumes_on_1_2_and_4_processes_and_loads_as_a_model(tiny, tmp_path):
    """--checkpoint-format sharded, SFT under FSDP2 on 2 processes: step 2's checkpoint holds no gathered weights
    (torch.distributed.checkpoint shards); resumed on 1, 2 and 4 processes, steps 3-4 log the uninterrupted
    full-format run's losses; its policy folder loads as a model (converted once), equal to the full checkpoint's."""
    import numpy as np
    from safetensors.torch import load_file

    from common.core import hub

    flags = lambda out, n: ["--model-name-or-path", tiny, "--output-dir", out, "--total-steps", n, "--eval-every", 0,
                            "--batch-size", 4, "--micro-batch-size", 1, "--learning-rate", 1e-3]  # noqa: E731  # fmt: skip
    evaluation = ["--eval-every", 4, "--num-eval-examples", 4, "--num-eval-prompts", 4, "--max-new-tokens", 4]
    launch("sft_llm.py", *flags(tmp_path / "full", 4), "--save-every", 2, *evaluation, config="cpu_2proc_fsdp2")
    launch("sft_llm.py", *flags(tmp_path / "sh", 2), "--checkpoint-format", "sharded", config="cpu_2proc_fsdp2")
    full, sharded = only_run(tmp_path / "full"), only_run(tmp_path / "sh")
    ckpt = sharded / "checkpoints" / "step_2"
    assert (ckpt / "sharded" / ".metadata").is_file() and not list(ckpt.glob("*/*.safetensors"))
    assert json.loads((ckpt / "checkpoint.json").read_text())["format"] == "sharded"
    converted = load_file(Path(hub.resolve_model_path(str(ckpt / "policy"))) / "model.safetensors")
    gathered = load_file(full / "checkpoints" / "step_2" / "policy" / "model.safetensors")
    assert set(gathered) <= set(converted)
    assert all(torch.allclose(converted[k], gathered[k], atol=1e-6) for k in gathered)
    assert_ran(full, "FSDP")
    assert {"eval/loss", "eval/accuracy"} <= set(read_metrics(full)[0]) and "eval/loss" in read_metrics(full)[-1]
    want = [r["loss/sft"] for r in read_metrics(full) if r["step"] in (3, 4)]
    for n in (1, 2, 4):
        copy = tmp_path / f"resumed{n}" / sharded.name
        shutil.copytree(sharded, copy)
        resume = [*flags(tmp_path / f"resumed{n}", 4), "--checkpoint-format", "sharded",
                  "--resume", copy / "checkpoints" / "step_2"]  # fmt: skip
        if n == 1:
            run_script("sft_llm.py", *resume)
        else:
            launch("sft_llm.py", *resume, config="cpu_2proc_fsdp2", processes=n)
        got = [r["loss/sft"] for r in read_metrics(copy) if r["step"] in (3, 4)]
        assert np.allclose(got, want, rtol=1e-4), (n, got, want)
