"""algos/ppo_llm.py end to end: run folder, parameters change, learning, exact resume, adaptive KL, LoRA."""

import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("script", ["ppo_llm", "dynamic_kl_ppo"])
def test_kl_controllers(script):
    """Ziegler et al.'s rule by hand: e = clip(KL / target - 1, +-0.2), beta *= 1 + e * n / horizon."""
    import importlib

    sys.path.insert(0, str(REPO / "algos"))
    KLController = importlib.import_module(script).KLController
    c = KLController(0.1, target=0.1, horizon=10000)
    c.update(0.2, 512)  # e = 0.2 (clipped from 1.0)
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 512 / 10000))
    c2 = KLController(0.1, target=0.1, horizon=10000)
    c2.update(0.05, 512)  # e = -0.5 clipped to -0.2: beta goes down
    assert c2.value == pytest.approx(0.1 * (1 - 0.2 * 512 / 10000))
    f = KLController(0.3)  # no target: fixed
    f.update(5.0, 512)
    assert f.value == 0.3
    c3 = KLController(1.0, 0.1, 100)
    c3.load_state_dict(c.state_dict())
    assert c3.value == c.value


def test_config_preset_loads_and_cli_overrides():
    import sys

    sys.path.insert(0, str(REPO / "algos"))
    import ppo_llm

    from common.harness.cli import parse_args

    preset = str(REPO / "configs" / "ppo_smollm2_cpu.yaml")
    a = parse_args(ppo_llm.Args, ["--config", preset])
    assert (a.run.total_steps, a.kl_target, a.gen.max_new_tokens, a.run.config) == (60, 0.1, 48, preset)
    b = parse_args(ppo_llm.Args, ["--config", preset, "--total-steps", "5", "--health.kl-max", "0.3"])
    assert b.run.total_steps == 5 and b.batch_size == 16 and b.health.kl_max == 0.3


@pytest.mark.parametrize("script", ["ppo_llm", "dynamic_kl_ppo"])
def test_the_retired_values_from_update_is_accepted_and_read_nowhere(script, tmp_path, capsys):
    """--values-from-update chose V_old from the critic's update forward with one critic step per batch: two
    code paths for one phase, for ~7 % of a step, so it was dropped (issue 31) and then retired (issue 50): on the
    command line (either spelling, with or without a value) and in a preset it is accepted with a note, and no script
    has it. GAE and whitening run in one place."""
    import importlib

    from common.harness.cli import parse_args

    sys.path.insert(0, str(REPO / "algos"))
    module = importlib.import_module(script)
    for argv in (["--no-values-from-update"], ["--values-from-update", "--total-steps", "3"],
                 ["--values-from-update=false", "--total-steps", "3"], ["--values-from-update", "False", "--total-steps", "3"]):  # fmt: skip
        assert parse_args(module.Args, argv).run.total_steps in (3, module.Args().run.total_steps), argv
        assert "--values-from-update: retired, ignored" in capsys.readouterr().err.replace("--no-", "--"), argv
    preset = tmp_path / "old.yaml"
    preset.write_text("values_from_update: true\ntotal_steps: 4\n")
    assert parse_args(module.Args, ["--config", str(preset)]).run.total_steps == 4
    assert f"--config {preset}: --values-from-update: retired" in capsys.readouterr().err
    source = (REPO / "algos" / f"{script}.py").read_text()
    assert "values_from_update" not in source and source.count("gae(") == 1
