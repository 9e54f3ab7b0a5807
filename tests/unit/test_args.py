"""The shared flag groups (common/harness/args.py): flat names, per-field checks, the resume rule, the flat record."""

import sys
from dataclasses import dataclass, field
from typing import Annotated, Optional

import pytest

from common.core.errors import UserError
from common.harness.args import (
    RESUME_MAY_CHANGE,
    Check,
    GenerationArgs,
    Group,
    ModelArgs,
    PositiveInt,
    RunArgs,
    UnitFloat,
    group,
)
from common.harness.cli import parse_args
from common.harness.flags import check_args, flags_of, flat_args, resume_may_change
from common.harness.health import HealthConfig
from conftest import REPO


@dataclass
class Toy:
    gamma: UnitFloat = 1.0
    """a discount"""
    steps: Annotated[PositiveInt, RESUME_MAY_CHANGE] = 3
    """how long"""
    cap: Annotated[Optional[float], Check(gt=1, note="a ratio")] = None
    """an optional bound"""
    health: HealthConfig = field(default_factory=HealthConfig)
    """a prefixed nested group"""
    run: Group[RunArgs] = group(RunArgs, exp_name="toy", total_steps=7)
    """flat"""
    gen: Group[GenerationArgs] = group(GenerationArgs)
    """flat"""


def test_groups_parse_with_flat_names_and_per_script_defaults():
    a = parse_args(Toy, ["--seed", "4", "--max-completion-length", "5", "--gamma", "0.5", "--health.kl-max", "2"])
    assert (a.run.seed, a.run.total_steps, a.run.exp_name) == (4, 7, "toy")
    assert (a.gen.max_new_tokens, a.gamma, a.health.kl_max) == (5, 0.5, 2.0)
    assert "seed" in flags_of(Toy) and "run" not in flags_of(Toy) and "health" in flags_of(Toy)


def test_flat_args_is_keyed_as_the_flags_are():
    flat = flat_args(parse_args(Toy, ["--seed", "4"]))
    assert flat["seed"] == 4 and flat["gamma"] == 1.0 and flat["max_new_tokens"] == 48
    assert flat["health"]["kl_max"] == HealthConfig().kl_max and "run" not in flat and "gen" not in flat


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gamma", "1.5"], "--gamma 1.5: must be in [0, 1]"),
        (["--steps", "0"], "--steps 0: must be > 0"),
        (["--cap", "0.5"], "--cap 0.5: must be > 1 (a ratio)"),
        (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
        (["--temperature", "0"], "--temperature 0.0: must be > 0 (sampling; evaluation is greedy already)"),
        (["--total-steps", "0"], "--total-steps 0: must be > 0"),
        (["--save-every", "-1"], "--save-every -1: must be >= 0"),
        (["--health.kl-max", "inf"], "--health.kl-max inf: must be a finite number"),
    ],
)
def test_each_field_carries_its_check(argv, message):
    with pytest.raises(UserError) as e:
        check_args(parse_args(Toy, argv))
    assert str(e.value) == message
    check_args(parse_args(Toy, []))  # the defaults pass
    check_args(parse_args(Toy, ["--cap", "2", "--gamma", "0", "--top-p", "1"]))  # the edges inside do too


def test_check_bounds_word_their_rule():
    for rule, v, text in [
        (Check(lt=0.5), 0.6, "must be < 0.5"),
        (Check(le=2), 3, "must be <= 2"),
        (Check(ge=2), 1, "must be >= 2"),
        (Check(gt=0, lt=1), 1.0, "must be in (0, 1)"),
        (Check(ge=0, lt=1), -1, "must be in [0, 1)"),
    ]:
        with pytest.raises(UserError, match=rf"--x {v}: {text.replace('(', '[(]').replace(')', '[)]')}"):
            rule("--x", v)
        rule("--x", None)  # an unset optional flag has nothing to check


def test_the_resume_rule_is_the_one_before_the_groups():
    """The flags a resume may change are those the list in common/harness/run.py named before the groups (1dbb602), and
    the flags added since that are marked so."""
    sys.path.insert(0, str(REPO / "algos"))
    import ppo_llm

    before = {
        "total_steps", "save_every", "save_every_minutes", "keep_last", "eval_every", "log_every",
        "num_samples_logged", "track", "wandb_project_name", "wandb_entity", "resume", "output_dir", "config",
        "save_merged", "save_best", "max_wall_minutes", "reward_timeout", "reward_workers", "tp_size",
    }  # fmt: skip
    added = {"reward_worker_max_gb"}  # flags added since, marked too (issue 38)
    added |= {"report_to", "service_timeout", "service_retries", "service_concurrency"}  # issue 37
    added |= {"env_timeout"}  # issue 33
    added |= {"checkpoint_format"}  # issue 37
    added |= {"tool_sandbox"}  # issue 53 (the isolation, not the numbers)
    added |= {"env_workers"}  # issue 54 (where environments run, not what they do)
    added |= {"vllm_server_url", "vllm_server_args", "vllm_server_devices", "vllm_server_port",  # issue 51: where
              "vllm_server_weights_dir", "vllm_server_timeout", "vllm_server_start_timeout"}  # the server lives  # fmt: skip
    added |= {"vllm_enforce_eager", "vllm_server_concurrency", "vllm_server_host"}  # issue 64: how, not what
    added |= {"tool_sandbox_url"}  # issue 66: where the tool's code runs, not what it computes
    assert resume_may_change(ppo_llm.Args()) == before | added
    assert "steps" in resume_may_change(Toy()) and "gamma" not in resume_may_change(Toy())


def test_model_args_default_is_the_offline_model():
    from common.core.defaults import DEFAULT_MODEL

    assert ModelArgs().model_name_or_path == DEFAULT_MODEL
