"""User errors end in one line and exit code 2 with nothing written; a stopped run resumes exactly.

A first part of the reliability catalogue (issue 17): each row runs a script as a user would, with one
mistake, and checks the message names the culprit, the exit code is 2 and no run folder was created.
"""

import json
import sys

import pytest

from conftest import REPO
from shared_bad_inputs import _Payload

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"

# (script, flags, fragment of the one-line message)
CASES = [
    ("ppo_llm.py", ["--kl-target", "0"], "--kl-target 0"),
    ("dynamic_kl_ppo.py", ["--kl-target", "-1"], "--kl-target -1"),
    ("ppo_llm.py", ["--batch-size", "6", "--mini-batch-size", "4"], "--batch-size over --mini-batch-size"),
    ("ppo_llm.py", ["--batch-size", "0"], "--batch-size 0: must be > 0"),
    ("grpo_llm.py", ["--group-size", "1"], "--group-size 1: must be >= 2"),
    ("dpo_llm.py", ["--online", "--group-size", "1"], "--online needs --group-size >= 2"),
    ("grpo_llm.py", ["--model-name-or-path", "./no/such/model"], "no such folder"),
    ("sft_llm.py", ["--model-name-or-path", "runs/x/checkpoints/step_9/policy"], "no such folder"),
    ("ppo_llm.py", ["--train-files", "data/typo/train.parquet"], "file not found"),
    ("grpo_llm.py", ["--train-files", "missing.jsonl"], "file not found"),
    ("grpo_llm.py", ["--train-files", "train.parq"], "train.parq: file not found (and .parq is not one of"),
    ("ppo_llm.py", ["--train-files", "data/train.parq"], "data/train.parq: file not found (and .parq is not one of"),
    ("sft_llm.py", ["--output-dir", "{a_file}/runs"], "is a file, not a folder"),
    ("ppo_llm.py", ["--reward-fn", "nope.py:fn"], "not found"),
    ("grpo_llm.py", ["--reward-fn", "no_colon"], "expected path/to/file.py:function_name"),
    ("ppo_llm.py", ["--reward", "rule:1,vibes:2"], "unknown source 'vibes'"),
    ("grpo_llm.py", ["--reward", "model:1"], "no --reward-model"),
    (
        "grpo_llm.py",
        ["--env", "tools", "--tool-format", "code", "--tools", "calculator"],
        "--tool-format code: the programs",
    ),
    ("grpo_llm.py", ["--reward-fn", f"{TOY_REWARD}", "--reward-weights", "0.5", "0.5"], "2 weight(s) for 1"),
    ("ppo_llm.py", ["--resume", "runs/never_ran"], "no complete checkpoint"),
    ("grpo_llm.py", ["--per-device-train-batch-size", "4"], "--micro-batch-size"),
    ("ppo_llm.py", ["--gradient-accumulation-steps", "4"], "--mini-batch-size"),
    ("dpo_llm.py", ["--chat-template-kwargs", "{bad json"], "not JSON"),
    ("sft_llm.py", ["--chat-template-kwargs", "[1, 2]"], "expected a JSON object"),
    # flag ranges, checked before anything loads
    (
        "sft_llm.py",
        ["--batch-size", "6", "--micro-batch-size", "4"],
        "--batch-size per process over --micro-batch-size",
    ),
    ("rm_llm.py", ["--batch-size", "0"], "--batch-size 0: must be > 0"),
    ("dpo_llm.py", ["--label-smoothing", "0.6"], "--label-smoothing 0.6: must be < 0.5"),
    ("ppo_llm.py", ["--temperature", "0"], "--temperature 0.0: must be > 0"),
    ("grpo_llm.py", ["--temperature", "-1"], "--temperature -1.0: must be > 0"),
    ("ppo_llm.py", ["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ("grpo_llm.py", ["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    ("ppo_llm.py", ["--gamma", "1.5"], "--gamma 1.5: must be in [0, 1]"),
    ("dynamic_kl_ppo.py", ["--lam", "-0.1"], "--lam -0.1: must be in [0, 1]"),
    ("grpo_llm.py", ["--reward-fallback", "nan"], "--reward-fallback nan: must be a finite number"),
    ("ppo_llm.py", ["--learning-rate", "0"], "--learning-rate 0.0: must be > 0"),
    ("grpo_llm.py", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be > 0"),
    ("grpo_llm.py", ["--num-prompts", "0"], "--num-prompts 0: must be > 0"),
    ("dpo_llm.py", ["--total-steps", "0"], "--total-steps 0: must be > 0"),
    ("sft_llm.py", ["--max-length", "0"], "--max-length 0: must be > 0"),
    ("ppo_llm.py", ["--kl-coef", "-0.1"], "--kl-coef -0.1: must be >= 0"),
    ("dynamic_kl_ppo.py", ["--policy-kl-target", "0"], "--policy-kl-target 0.0: must be > 0"),
    ("grpo_llm.py", ["--tis-cap", "-1"], "--tis-cap -1.0: must be >= 0"),
    ("ppo_llm.py", ["--save-every", "-1"], "--save-every -1: must be >= 0"),
    ("rm_llm.py", ["--micro-batch-size", "0"], "--micro-batch-size 0: must be > 0"),
    ("grpo_llm.py", ["--reward-timeout", "-5"], "--reward-timeout -5.0: must be >= 0"),
    ("ppo_llm.py", ["--tis-cap", "0.5"], "--tis-cap 0.5: must be 0 (off) or >= 1"),
    ("grpo_llm.py", ["--dtype", "float16"], "--dtype float16: training float16 weights needs a loss scaler"),
    ("grpo_llm.py", ["--report-to", "tensorbord"], "--report-to tensorbord: unknown tracker(s) ['tensorbord']"),
    ("grpo_llm.py", ["--reward-url", "ftp://x"], "--reward-url ftp://x: not an http:// or https:// URL"),
    ("ppo_llm.py", ["--reward", "rule:1,remote:1"], "--reward includes 'remote' but no --reward-url"),
    ("distill_llm.py", [], "--teacher: required"),
    (
        "distill_llm.py",
        ["--teacher", "{tiny}", "--lmbda", "0.5", "--train-files", "{no_reference}"],
        "--lmbda 0.5 trains on the data's reference responses, and 1 training rows have none (e.g. row 1)",
    ),
    (
        "distill_llm.py",
        ["--teacher", "{tiny}", "--teacher-engine", "vllm", "--loss", "reverse-kl-pg", "--lmbda", "0.5"],
        "--loss reverse-kl-pg (with --lmbda 1)",
    ),
    # paths
    ("rm_llm.py", ["--model-name-or-path", "./missing_model"], "no such folder"),
    ("dpo_llm.py", ["--model-name-or-path", "../elsewhere/model"], "no such folder"),
    ("dynamic_kl_ppo.py", ["--train-files", "missing.parquet"], "file not found"),
    ("rm_llm.py", ["--train-files", "missing.parquet"], "file not found"),
    ("sft_llm.py", ["--train-files", "missing.jsonl"], "file not found"),
    ("dpo_llm.py", ["--train-files", "missing.parquet"], "file not found"),
    ("ppo_llm.py", ["--config", "missing.yaml"], "--config missing.yaml: file not found"),
    ("dpo_llm.py", ["--online", "--reward-fn", "nope.py:fn"], "not found"),
    ("sft_llm.py", ["--resume", "nowhere"], "no complete checkpoint"),
    ("grpo_llm.py", ["--max-prompt-length", "2040", "--max-new-tokens", "48"], "more than the model's context of 2048"),
    ("sft_llm.py", ["--max-length", "4096"], "--max-length = 4096 tokens: more than the model's context"),
    # rewards
    ("ppo_llm.py", ["--reward", ""], "--reward is empty"),
    ("grpo_llm.py", ["--reward", "rule:abc"], "weight of 'rule' is not a number"),
    # data rows (files made by the bad_files fixture)
    ("ppo_llm.py", ["--train-files", "{empty_prompt}"], "row 1 column 'prompt': empty text"),
    ("grpo_llm.py", ["--train-files", "{empty_message}"], "message 0 (user) has empty"),
    ("grpo_llm.py", ["--train-files", "{latin1}"], "cannot be read as .jsonl"),
    ("ppo_llm.py", ["--train-files", "{zero_rows}"], "file is empty"),
    ("dynamic_kl_ppo.py", ["--train-files", "{no_source}"], "column(s) ['data_source'] missing"),
    ("grpo_llm.py", ["--train-files", "{unknown_source}"], "unknown data_source ['nobody/knows']"),
    ("sft_llm.py", ["--train-files", "{null_response}"], "row 1 column 'response'"),
    ("dpo_llm.py", ["--train-files", "{no_rejected}"], "column(s) ['rejected'] missing"),
    # issue 38: non-finite numbers, the vLLM engine's ranges, QLoRA without CUDA, a reward file that fails to
    # import, --save-best that could never save
    ("ppo_llm.py", ["--learning-rate", "inf"], "--learning-rate inf: must be a finite number"),
    ("grpo_llm.py", ["--health.kl-max", "nan"], "--health.kl-max nan: must be a finite number"),
    ("sft_llm.py", ["--max-grad-norm", "-inf"], "--max-grad-norm -inf: must be a finite number"),
    ("ppo_llm.py", ["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization 1.5: must be in (0, 1]"),
    ("grpo_llm.py", ["--vllm-kv-cache-gb", "-5"], "--vllm-kv-cache-gb -5.0: must be > 0"),
    ("grpo_llm.py", ["--reward-fn", "{bad_import}"], "failed to import: ModuleNotFoundError"),
    ("ppo_llm.py", ["--save-best", "eval/accuracy", "--eval-every", "0"], "never evaluates (--eval-every 0)"),
    ("sft_llm.py", ["--save-best", "eval/loss", "--eval-every", "0"], "never evaluates (--eval-every 0)"),
    ("rm_llm.py", ["--train-files", "{bad_messages}"], "expected a string or a list of {role, content} messages"),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return make_bad_files(tmp_path_factory.mktemp("bad_data"))


def make_bad_files(d):
    """The catalogue's bad data files in folder d (also used by benchmarks/bad_inputs.py)."""

    def jsonl(name, rows):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(d / name)

    ok = {"prompt": "What is 1 + 1?", "data_source": "reasoning_gym/chain_sum", "reward_model": {"ground_truth": "2"}}
    (d / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "data_source": "x"}\n'.encode("latin-1"))
    (d / "zero.jsonl").write_text("")
    return {
        "empty_prompt": jsonl("empty_prompt.jsonl", [ok, {**ok, "prompt": "   "}]),
        "empty_message": jsonl("empty_message.jsonl", [{**ok, "prompt": [{"role": "user", "content": ""}]}]),
        "latin1": str(d / "latin1.jsonl"),
        "zero_rows": str(d / "zero.jsonl"),
        "no_source": jsonl("no_source.jsonl", [{"prompt": "hi"}]),
        "unknown_source": jsonl("unknown_source.jsonl", [{**ok, "data_source": "nobody/knows"}]),
        "null_response": jsonl(
            "null_response.jsonl", [{"prompt": "q", "response": "a"}, {"prompt": "q", "response": None}]
        ),
        "no_rejected": jsonl("no_rejected.jsonl", [{"prompt": "q", "chosen": "a"}]),
        "bad_import": (d / "rw_import.py").write_text("import not_a_module_anywhere\n") and f"{d}/rw_import.py:f",
        "a_file": (d / "a_file").write_text("not a folder") and str(d / "a_file"),
        "no_reference": jsonl("no_reference.jsonl", [ok, {**ok, "reward_model": {"ground_truth": " "}}]),
        "bad_messages": jsonl("bad_messages.jsonl", [{"prompt": {"text": "q"}, "chosen": "a", "rejected": "b"}]),
    }


if not __import__("torch").cuda.is_available():  # the refusal of a machine without CUDA
    CASES.append(("grpo_llm.py", ["--rollout-engine", "vllm-server", "--vllm-server-transfer", "nccl"],
                  "--vllm-server-transfer nccl needs GPUs"))  # fmt: skip

CASES.append(("sft_llm.py", ["--load-in-4bit"], "--load-in-4bit (QLoRA) trains LoRA adapters only: set --lora-r > 0"))

CASES += [  # a generator device this machine lacks: refused before the run folder exists (it was left empty)
    ("async_grpo.py", ["--generator-device", "cuda:3"], "--generator-device cuda:3: the trainer runs on cpu")
]

CASES += [  # a vLLM server that is not there (port 9: nothing listens), or is not vLLM (checked before any model work)
    ("ppo_llm.py", ["--rollout-engine", "vllm-server", "--vllm-server-url", "http://127.0.0.1:9"],
     "--vllm-server-url http://127.0.0.1:9: no vLLM server answers"),
    ("grpo_llm.py", ["--rollout-engine", "vllm-server", "--vllm-server-url", "not-a-url"], "--vllm-server-url not-a-url"),
]  # fmt: skip

# the tools: (module, flags, fragment); "{tiny}" is the tiny model folder
TOOL_CASES = [
    ("tools.evaluate", ["--model", "{tiny}"], "Unrecognized options: --model"),
    ("tools.evaluate", ["--models", "./missing"], "model ./missing: no such folder"),
    ("tools.evaluate", ["--models", "{tiny}", "--data", "missing.parquet"], "missing.parquet: file not found"),
    ("tools.evaluate", ["--models", "{tiny}", "--n", "-1"], "--n -1: must be >= 0"),
    (
        "tools.evaluate",
        ["--models", "{tiny}", "--n", "2", "--sample-temperature", "0"],
        "--sample-temperature 0.0: must be > 0",
    ),
    ("tools.gen_preferences", ["--model", "{tiny}", "--prompts", "missing.parquet"], "missing.parquet: file not found"),
    (
        "tools.gen_preferences",
        ["--model", "{tiny}", "--prompts", "p.jsonl", "--group-size", "1"],
        "--group-size 1: must be >= 2",
    ),
    ("tools.compare", ["no_runs/"], "no_runs: no metrics.jsonl"),
    ("tools.export", ["runs/none/checkpoints/step_3", "--out", "exp"], "no such file or folder"),
    ("tools.prepare_data", ["--tasks", "no_such_task"], "unknown reasoning-gym dataset(s) ['no_such_task']"),
    ("tools.prepare_data", ["--test-fraction", "1.5"], "--test-fraction 1.5: must be in (0, 1)"),
]


# --------------------------------------------------------------------------- the resume guard (issue 38)
def _resume_args(**run):
    from dataclasses import dataclass

    from common.harness.args import Group, RunArgs, group

    @dataclass
    class Args:
        lr: float = 0.1
        """a flag a resume may not change"""
        run: Group[RunArgs] = group(RunArgs, exp_name="x")

    return Args


def _run_with_checkpoint(root, name, lr=0.1, run_id=None, args_json=True):
    """A run folder as save_checkpoint and make_run_dir leave it: checkpoints/step_1 with checkpoint.json."""
    from accelerate import Accelerator

    from common.harness import checkpoint as C
    from common.harness.args import RunArgs
    from common.harness.flags import flat_args

    Args = _resume_args()
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    args = Args(lr=lr, run=RunArgs(exp_name="x", output_dir=str(root), total_steps=5))
    (run / "args.json").write_text(json.dumps({**flat_args(args), "run_id": run_id or name}))
    C.save_checkpoint(Accelerator(cpu=True), run, 1, {}, {}, args=args)
    if not args_json:
        (run / "args.json").unlink()
    return run


def _resume(path, lr=0.1):
    from common.harness.args import RunArgs
    from common.harness.tracking import resolve_resume

    Args = _resume_args()
    return resolve_resume(Args(lr=lr, run=RunArgs(exp_name="x", resume=str(path), total_steps=5)), "ppo_llm")


@pytest.mark.parametrize("script,flags,fragment", CASES, ids=[f"{c[0]}:{' '.join(c[1])[:40]}" for c in CASES])
def test_user_error_is_one_line_exit_2_nothing_written(
    tiny, tmp_path, monkeypatch, capsys, bad_files, script, flags, fragment
):
    """In-process, as `python algos/<script> ...` runs it (cli), so the table stays fast."""
    import importlib

    named = {**bad_files, "tiny": tiny}
    flags = [f.format(**named) if any(f"{{{k}}}" in f for k in named) else f for f in flags]
    from common.harness.cli import cli

    sys.path.insert(0, str(REPO / "algos"))
    module = importlib.import_module(script[:-3])
    base = [] if "--model-name-or-path" in flags else ["--model-name-or-path", tiny]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOY_MODEL", tiny)
    out = [] if "--output-dir" in flags else ["--output-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", [script, *base, *flags, *out])
    with pytest.raises(SystemExit) as exit_info:
        cli(module.main, module.Args)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "out").exists()  # no run folder for a run that never started


@pytest.mark.parametrize("tool,flags,fragment", TOOL_CASES, ids=[f"{c[0]}:{' '.join(c[1])[:40]}" for c in TOOL_CASES])
def test_tool_user_error_is_one_line_exit_2(tiny, tmp_path, monkeypatch, capsys, tool, flags, fragment):
    """The tools (`python -m tools.X`) run through the same cli: one line, exit 2, nothing written."""
    import importlib

    from common.harness.cli import cli

    module = importlib.import_module(tool)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [tool, *[f.format(tiny=tiny) for f in flags]])
    with pytest.raises(SystemExit) as exit_info:
        cli(module.main, module.Args)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert exit_info.value.code == 2, err
    assert len(err) == 1 and fragment in err[0], err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_deepspeed_engine_files_are_vetted_before_loading(tmp_path):
    """DeepSpeed's load_checkpoint unpickles with weights_only=False: its files are scanned first."""
    import torch

    from common.parallel.sharded import check_deepspeed_files

    folder = tmp_path / "deepspeed" / "state"
    folder.mkdir(parents=True)
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save(
        {"optimizer_state_dict": {"zero_stage": ZeroStageEnum(2)}, "w": torch.ones(2)},
        folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    (tmp_path / "deepspeed" / "zero_to_fp32.py").write_text("print('never run')\n")
    check_deepspeed_files(tmp_path / "deepspeed")  # DeepSpeed's own classes pass
    marker = tmp_path / "PWNED"
    torch.save({"optimizer_state_dict": _Payload(marker)}, folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match="which loading would execute"):
        check_deepspeed_files(tmp_path / "deepspeed")
    assert not marker.exists()


def test_rollout_engine_vllm_without_vllm_names_the_install(monkeypatch):
    import sys

    from common.core.errors import UserError
    from common.integrations.vllm_engine import require_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(UserError, match="requirements-vllm.txt.*pip install vllm"):
        require_vllm()


def test_output_dir_that_is_a_dangling_symlink_or_a_file(tiny, tmp_path, monkeypatch, capsys):
    """--output-dir is checked before anything loads: a symlink to nothing, or a file, is one line and exit 2."""
    import importlib

    from common.harness.cli import cli

    sys.path.insert(0, str(REPO / "algos"))
    module = importlib.import_module("grpo_llm")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "a_file").write_text("x")
    for out, fragment in (("dangling", "a symlink to nothing"), ("a_file", "a file, not a folder")):
        monkeypatch.setattr(
            sys, "argv", ["grpo_llm.py", "--model-name-or-path", tiny, "--output-dir", str(tmp_path / out)]
        )
        with pytest.raises(SystemExit) as exit_info:
            cli(module.main, module.Args)
        err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
        assert exit_info.value.code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "gone").exists() and (tmp_path / "a_file").read_text() == "x"


def test_a_preset_with_a_name_and_its_alias_for_one_field_is_refused(tmp_path, capsys):
    """YAML keeps the last of two keys for one field without a word; the preset is refused, naming both."""
    from common.harness.cli import parse_args

    sys.path.insert(0, str(REPO / "algos"))
    import grpo_llm

    preset = tmp_path / "p.yaml"
    preset.write_text("group_size: 4\nnum_generations: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(grpo_llm.Args, ["--config", str(preset)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "'group_size' and 'num_generations' set the same field" in err, err


def test_a_torn_metrics_line_is_skipped_by_compare_and_dropped_on_resume(tmp_path, capsys):
    """A crash mid-write tears the last line of metrics.jsonl: tools.compare skips it with a warning, and the
    resume's clean-up (rows after the checkpoint's step) drops it instead of dying on it."""
    from common.harness.tracking import _drop_rows_after
    from tools.compare import load_run

    run = tmp_path / "ppo_llm__x__1__1"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "train/reward": 0.5}\n{"step": 2, "train/reward": 0.7}\n{"step": 3, "tr'
    )
    assert [r["step"] for r in load_run(run)["rows"]] == [1, 2]
    assert "line 3: not a complete JSON row" in capsys.readouterr().err
    _drop_rows_after(run / "metrics.jsonl", 2, warn=print)
    assert (run / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "train/reward": 0.5}',
        '{"step": 2, "train/reward": 0.7}',
    ]


def test_a_damaged_args_json_on_resume_is_one_line(tmp_path, capsys):
    """--resume of a run whose args.json was cut short: one line naming the file, exit 2 (was a JSONDecodeError)."""
    import types

    import torch

    from common.harness.tracking import resolve_resume

    run = tmp_path / "ppo_llm__x__1__1"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    torch.save({}, run / "checkpoints" / "step_1" / "trainer_state.pt")
    (run / "args.json").write_text('{"seed": 1, "learning_ra')
    args = types.SimpleNamespace(
        run=types.SimpleNamespace(resume=str(run), output_dir=str(tmp_path), exp_name="x", seed=1, total_steps=5)
    )
    with pytest.raises(SystemExit) as exit_info:
        resolve_resume(args, "ppo_llm")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "args.json: damaged" in err and len(err.strip().splitlines()) == 1, err


def test_a_model_folder_whose_bin_holds_code_is_one_line(tiny, tmp_path):
    """A model folder whose pytorch_model.bin holds a pickle payload: refused by weights_only loading, as one
    UserError naming the folder (was an UnpicklingError traceback quoting torch's migration text); never run."""
    import shutil

    import torch

    from common.core import models as M
    from common.core.errors import UserError

    folder = tmp_path / "evil_model"
    shutil.copytree(tiny, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "PWNED"
    torch.save({"model.norm.weight": _Payload(marker)}, folder / "pytorch_model.bin")
    for load in (M.load_causal_lm, M.load_reward_model):
        with pytest.raises(UserError, match="a weights file holds code, not only tensors; refused"):
            load(str(folder))
    assert not marker.exists()


def test_the_resume_guard_holds_without_args_json(tmp_path, capsys):
    """args.json deleted: a changed --lr was silently applied and recorded (issue 38); the checkpoint carries its
    own record of the flags (checkpoint.json), and the guard reads it."""
    run = _run_with_checkpoint(tmp_path, "ppo_llm__x__1__1", args_json=False)
    assert (run / "checkpoints/step_1/checkpoint.json").exists()
    assert json.loads((run / "checkpoints/step_1/checkpoint.json").read_text())["run_id"] == run.name
    assert _resume(run) == run / "checkpoints/step_1"  # the same flags: resumes
    with pytest.raises(SystemExit) as e:
        _resume(run, lr=0.5)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--lr 0.1 -> 0.5" in err and "checkpoint.json" in err, err


def test_a_step_folder_from_another_run_is_refused(tmp_path, capsys):
    """A step_N that is a symlink to, or a copy of, another run's checkpoint loaded that run's state, overwrote
    this run's later checkpoints and duplicated metric rows (issue 38): refused by name. A renamed run folder
    (its checkpoints and args.json agree on the run) still resumes."""
    import shutil

    mine = _run_with_checkpoint(tmp_path, "ppo_llm__x__1__1")
    other = _run_with_checkpoint(tmp_path, "ppo_llm__x__1__2")
    (mine / "checkpoints/step_2").symlink_to(other / "checkpoints/step_1")
    for path, says in ((mine / "checkpoints/step_2", "is a link to"), (mine, "is a link to")):
        with pytest.raises(SystemExit) as e:
            _resume(path)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    (mine / "checkpoints/step_2").unlink()
    shutil.copytree(other / "checkpoints/step_1", mine / "checkpoints/step_3")
    with pytest.raises(SystemExit) as e:
        _resume(mine)  # its latest: step_3, the copy
    err = capsys.readouterr().err
    assert e.value.code == 2 and "written by run ppo_llm__x__1__2" in err, err
    shutil.rmtree(mine / "checkpoints/step_3")
    renamed = mine.rename(tmp_path / "ppo_llm__x__1__renamed")
    assert _resume(renamed) == renamed / "checkpoints/step_1"


def test_export_leaves_out_stray_files(tiny, tmp_path, capsys):
    """tools.export copied every file of the checkpoint's model folder, a stray pytorch_model.bin (a pickle) too,
    into the folder meant for the Hub (issue 38): it copies the safetensors model folder's own files only, says
    what it left out, and refuses a folder with no safetensors weights."""
    import shutil

    from common.core.errors import UserError
    from tools import export

    src = tmp_path / "ckpt" / "policy"
    shutil.copytree(tiny, src)
    (src / "pytorch_model.bin").write_bytes(b"not a model")
    (src / "notes.txt").write_text("scratch")
    out = export.main(export.Args(checkpoint=str(src), out=str(tmp_path / "out")))
    names = sorted(p.name for p in out.iterdir())
    assert "pytorch_model.bin" not in names and "notes.txt" not in names and "model.safetensors" in names
    assert "config.json" in names and "tokenizer_config.json" in names and "README.md" in names
    said = capsys.readouterr().out
    assert "left out pytorch_model.bin" in said and "left out notes.txt" in said
    (src / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no .safetensors weights; nothing was written"):
        export.main(export.Args(checkpoint=str(src), out=str(tmp_path / "out2")))
    assert not (tmp_path / "out2").exists()


def test_a_damaged_checkpoint_names_the_file_and_the_intact_one(tmp_path, capsys):
    """A truncated trainer_state.pt (PytorchStreamReader traceback) or model.safetensors (SafetensorError) on
    --resume: one line naming the damaged file and the newest earlier checkpoint that is whole (issue 38);
    --resume auto resumes that one, saying why."""
    from pathlib import Path

    import torch
    from accelerate import Accelerator

    from common.core.errors import UserError
    from common.harness import checkpoint as C
    from common.harness.args import RunArgs
    from common.harness.flags import flat_args

    Args = _resume_args()
    run = tmp_path / "ppo_llm__x__1__1"
    args = Args(run=RunArgs(exp_name="x", output_dir=str(tmp_path), total_steps=5))
    (run / "checkpoints").mkdir(parents=True)
    (run / "args.json").write_text(json.dumps({**flat_args(args), "run_id": run.name}))

    class Weights(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64, 64))

        def save_pretrained(self, path, state_dict=None, safe_serialization=True):
            from safetensors.torch import save_file

            Path(path).mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in state_dict.items()}, Path(path) / "model.safetensors")

    for step in (1, 2, 3):
        C.save_checkpoint(Accelerator(cpu=True), run, step, {"policy": Weights()}, {}, args=args)
    cut = lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cut(run / "checkpoints/step_3/trainer_state.pt")
    cut(run / "checkpoints/step_2/policy/model.safetensors")
    for path, damaged in (
        (run, "step_3/trainer_state.pt"),
        (run / "checkpoints/step_2", "step_2/policy/model.safetensors"),
    ):
        with pytest.raises(SystemExit) as e:
            _resume(path)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"{damaged}: damaged" in err and "step_1 is intact: --resume" in err, err
    from common.harness.tracking import resolve_resume

    auto = Args(run=RunArgs(exp_name="x", resume="auto", output_dir=str(tmp_path), total_steps=5))
    assert resolve_resume(auto, "ppo_llm") == run / "checkpoints/step_1"
    assert "trying the checkpoint before it" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"trainer_state.pt: damaged .*step_1 is intact"):
        C.load_trainer_state(run / "checkpoints/step_3")  # the loader's own message, had a check been skipped


def test_a_damaged_model_folder_is_one_line_for_every_loader(tiny, tmp_path):
    """A truncated model.safetensors in a folder given as the policy, the critic's body or --reward-model:
    SafetensorError tracebacks (issue 38's neighbours); one line naming the folder for each loader."""
    import shutil

    from common.core import chat
    from common.core import models as M
    from common.core.errors import UserError

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    tok = chat.load_tokenizer(tiny)
    for load in (M.load_causal_lm, M.load_value_model, M.load_reward_model):
        with pytest.raises(UserError, match=r"model .*bad: a damaged .safetensors weights file"):
            load(str(bad), tok)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_json_file_in_a_model_folder_is_one_line(tiny, tmp_path, name):
    """A cut config or tokenizer file in a model folder (a checkpoint's policy/ used to start the next stage):
    transformers' JSONDecodeError / OSError traceback before; one line naming the folder and the file, for the
    tokenizer and every model loader."""
    import shutil

    from common.core import chat
    from common.core import models as M
    from common.core.errors import UserError

    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    f = bad / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    tok = chat.load_tokenizer(tiny)
    loaders = (chat.load_tokenizer, lambda p: M.load_causal_lm(p, tok), lambda p: M.load_reward_model(p, tok))
    for load in loaders:
        with pytest.raises(UserError, match=rf"model .*bad: {name} is damaged \(not valid JSON"):
            load(str(bad))
