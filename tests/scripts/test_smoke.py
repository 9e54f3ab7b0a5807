"""One short run of every script in algos/ (discovered: a copy is tested from the moment it exists), as a user
launches it (`python algos/X.py` with the script's own SMOKE flags: a tiny model, the built-in default task or a toy
one): exits 0, writes its run folder, metrics and a copy of its code, saves a checkpoint whose model folders load
with plain transformers, and changed the trained weights. These are the fast tier's only process launches (CleanRL's
test per script); the longer runs (learning, resume, pipelines) are marked e2e."""

import ast
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, only_run, read_metrics, run_script

TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"
SCRIPTS = sorted(p.name for p in (REPO / "algos").glob("*.py"))


def smoke_flags(path) -> str:
    """The script's module constant SMOKE (read with ast: the script is not imported)."""
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["SMOKE"]:
            return ast.literal_eval(node.value)
    raise AssertionError(
        f"{Path(path).name} declares no SMOKE: add the flags of a two-step run on a tiny model (see algos/grpo_llm.py)"
    )


@pytest.fixture(scope="module")
def smoke_runs(request, tiny, tiny_peaky, toy_prompts, tmp_path_factory):
    """The smoke runs of the scripts this session selected, two at a time (each process runs torch on one thread:
    conftest's _one_thread_per_launched_process, so two keep both cores busy; one at a time, the suite waited ~60 s
    more): script -> (CompletedProcess, its output folder, its flags), or the exception its launch raised."""
    from concurrent.futures import ThreadPoolExecutor

    fixtures = dict(tiny=tiny, tiny_peaky=tiny_peaky, toy_prompts=toy_prompts, toy_reward=TOY_REWARD)
    wanted = [
        i.callspec.params["script"] for i in request.session.items if i.originalname == "test_script_runs_two_steps"
    ]

    def launch(script):
        flags = smoke_flags(REPO / "algos" / script).format(**fixtures).split()
        out = tmp_path_factory.mktemp(script.removesuffix(".py"))
        try:
            proc = run_script(script, *flags, "--total-steps", 2, "--eval-every", 2, "--learning-rate", 1e-3,
                              "--output-dir", out, env={"TOY_MODEL": tiny_peaky}, fresh=True)  # a quiet start: checked  # fmt: skip
        except Exception as e:  # noqa: BLE001  # raised in that script's own test
            return e
        return proc, out, flags

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(wanted, pool.map(launch, wanted)))


@pytest.mark.smoke
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_runs_two_steps(script, smoke_runs):
    """Discovered: every algos/*.py (a new copy included) runs its SMOKE flags for 2 steps."""
    if isinstance(smoke_runs[script], Exception):
        raise smoke_runs[script]
    proc, tmp_path, flags = smoke_runs[script]
    base_model = flags[flags.index("--model-name-or-path") + 1]
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
    base = load_file(Path(base_model) / "model.safetensors")
    trained = sorted(d.name for d in ckpt.iterdir() if (d / "model.safetensors").exists())
    assert trained, f"{script}: no model folder in {ckpt}"
    for name in trained:  # every model the checkpoint holds (policy; PPO's critic; the reward model) was trained
        saved = load_file(ckpt / name / "model.safetensors")
        changed = [k for k in base if k in saved and not torch.equal(base[k], saved[k])]
        assert changed, f"{script}: {name} saved unchanged weights"
    from transformers import AutoConfig

    AutoConfig.from_pretrained(ckpt / trained[0])
    assert (run / "code" / script).read_text() == (REPO / "algos" / script).read_text()  # the code that ran, kept


@pytest.mark.e2e
def test_a_copied_and_edited_script_passes_the_suite(tiny_peaky, toy_prompts, tmp_path):
    """The README's "Try an idea", done as a researcher does it: copy grpo_llm.py to a new script in algos/, change
    its loss (here a made-up term), and the house rules and the smoke run (which discovers the copy) pass on that
    tree; the copy's run folder keeps the edited code. Also a critic-free PPO made by deleting ppo_llm.py's
    `# CRITIC` blocks runs its smoke test (its checkpoint: the policy alone)."""
    import os
    import shutil
    import subprocess
    import sys

    tree = tmp_path / "repo"
    for part in ("algos", "common", "tests", "configs", "tools"):
        shutil.copytree(REPO / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pytest.ini", "pyproject.toml"):
        shutil.copy(REPO / name, tree / name)
    src = (tree / "algos" / "grpo_llm.py").read_text()
    old = '    return torch.max(pg1, pg2), {"clip_frac": (pg2 > pg1).float()}\n'
    assert src.count(old) == 1
    mine = [
        "    drift = (logprobs - old_logprobs) ** 2  # my idea: a penalty on moving away from pi_old",
        '    return torch.max(pg1, pg2) + 0.01 * drift, {"clip_frac": (pg2 > pg1).float(), "neg_adv": (advantages < 0)}',
        "",
        "",
        "grpo_loss.reads_pi_old = True  # pi_old recomputed before the update (a batch-level rule may read it)",
    ]
    edited = src.replace(old, "\n".join(mine) + "\n")
    (tree / "algos" / "grpo_idea.py").write_text(edited)
    from shared_house import strip_marked  # and PPO without its critic: the marked blocks deleted (REINFORCE + KL)

    (tree / "algos" / "ppo_no_critic.py").write_text(strip_marked((tree / "algos" / "ppo_llm.py").read_text()))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider", "tests/unit/test_house.py",
         "tests/scripts/test_smoke.py::test_script_runs_two_steps[grpo_idea.py]",
         "tests/scripts/test_smoke.py::test_script_runs_two_steps[ppo_no_critic.py]"],
        cwd=tree, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "PASSED tests/scripts/test_smoke.py::test_script_runs_two_steps[grpo_idea.py]" in proc.stdout, proc.stdout[
        -3000:
    ]
    assert "PASSED tests/unit/test_house.py::test_marked_copies_stay_identical" in proc.stdout
    assert "PASSED tests/scripts/test_smoke.py::test_script_runs_two_steps[ppo_no_critic.py]" in proc.stdout
    assert (tree / "algos" / "grpo_idea.py").read_text() == edited
    # run as a user does: its named statistic is logged (train/neg_adv), pi_old is recomputed, its code is kept
    out = tmp_path / "runs"
    flags = smoke_flags(tree / "algos" / "grpo_idea.py").format(tiny=tiny_peaky, tiny_peaky=tiny_peaky,
                                                                toy_prompts=toy_prompts, toy_reward=TOY_REWARD)  # fmt: skip
    subprocess.run([sys.executable, str(tree / "algos" / "grpo_idea.py"), *flags.split(), "--total-steps", "1",
                    "--output-dir", str(out)], check=True, capture_output=True, env={**os.environ, "TOY_MODEL": tiny_peaky})  # fmt: skip
    run = only_run(out)
    assert json.loads((run / "args.json").read_text())["old_logprobs_from"] == "trainer"
    assert 0 <= read_metrics(run)[-1]["train/neg_adv"] <= 1 and "train/clip_frac" in read_metrics(run)[-1]
    assert (run / "code" / "grpo_idea.py").read_text() == edited


@pytest.mark.e2e
def test_the_zygote_runs_a_script_as_a_fresh_process_does(tiny, tmp_path):
    """tests/helpers/zygote.py (run_script's warm start): the same exit code and output as `python algos/X.py` for a help
    text and a refused flag; a launch whose environment differs in an import-time variable starts fresh; a timeout
    kills the child and raises as subprocess.run does."""
    import subprocess

    import conftest

    for flags in (["--help"], ["--model-name-or-path", tiny, "--kl-target", "0", "--output-dir", tmp_path / "x"]):
        warm, fresh = (run_script("ppo_llm.py", *flags, check=False, fresh=f) for f in (False, True))
        assert warm.returncode == fresh.returncode and warm.stdout == fresh.stdout, (warm.stderr, fresh.stderr)
        mine = lambda p: [x for x in p.stderr.splitlines() if x.startswith(("error", "[cleanrlhf]", "usage"))]
        assert mine(warm) == mine(fresh)
    from zygote import import_env

    z = conftest._ZYGOTE[import_env({**os.environ})]
    served = z.n
    assert not z.serves([sys.executable, str(REPO / "algos/ppo_llm.py")], {**z.env, "HF_HUB_OFFLINE": "0"}, REPO)
    assert z.serves([sys.executable, str(REPO / "algos/ppo_llm.py")], {**z.env, "TOY_MODEL": "x"}, REPO)
    # pytest names the running test in the environment: a later test's launches are served too
    assert z.serves([sys.executable, str(REPO / "algos/ppo_llm.py")], {**z.env, "PYTEST_CURRENT_TEST": "b"}, REPO)
    assert not z.serves([sys.executable, str(tmp_path / "other.py")], z.env, REPO)  # another tree's script
    flags = ["--model-name-or-path", tiny, "--output-dir", tmp_path / "slow", "--total-steps", 1000]
    with pytest.raises(subprocess.TimeoutExpired):
        run_script("ppo_llm.py", *flags, timeout=3)
    assert z.n == served + 1 and z.proc.poll() is None  # the timed-out child went through the zygote, which lives on
