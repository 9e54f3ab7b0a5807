"""The house rules, checked: copied code stays identical (TRL's rule), the library stays apart from
the tools, and the algorithm (losses, advantages, KL controllers) lives in the scripts."""

import json

import pytest


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["cpu_2proc", "cpu_2proc_fsdp2"])
def test_warm_launched_ranks_get_the_environment_accelerate_launch_gives(config, tmp_path):
    """conftest.launch_ranks forks a launch's processes from the test zygote instead of running `accelerate launch`:
    each gets the environment a real launch gives its workers (a script that records it, under both), but for
    the rendezvous port (free, per launch), the agent's store (hosted by rank 0: no agent) and its error files."""
    import subprocess

    from conftest import accelerate_launch, accelerate_ranks

    probe = tmp_path / "envdump.py"
    probe.write_text("import json, os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').write("
                     "json.dumps(dict(os.environ)))\n")  # fmt: skip
    proc = subprocess.run([*accelerate_launch(config), str(probe), str(tmp_path)], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours = accelerate_ranks(config)
    assert len(ours) == 2
    for rank, env in enumerate(ours):
        real = json.loads((tmp_path / str(rank)).read_text())
        differ = {k for k in set(real) | set(env) if real.get(k) != env.get(k)} - {"COLUMNS", "LINES"}  # a terminal's
        assert differ == {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"}, differ
    assert ours[0]["ACCELERATE_USE_FSDP" if "fsdp" in config else "ACCELERATE_MIXED_PRECISION"]
