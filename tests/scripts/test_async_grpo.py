"""algos/async_grpo.py: the weight mailbox's ordering, the batches a checkpoint keeps, K = 0 equals grpo_llm.py,
K = 1 samples one update behind, resumes exactly with every prompt consumed once, learns the toy task, and a
generator that dies or hangs ends the run in one line with a checkpoint."""

import json
import shutil
import subprocess
import time

import pytest
import torch

from common.integrations.async_generator import GeneratorFailed
from common.integrations.weight_mailbox import make_mailbox
from conftest import REPO, only_run, read_metrics, run_script
from shared_async_grpo import TOY_REWARD, _ctx, _flags, _slow_to_start, _strip


def _hold_lock(lock, held, stop):
    """A stand-in generator that takes the mailbox's lock, then freezes (SIGSTOP) or dies (holding it either way)."""
    import os
    import signal

    lock.acquire()
    held.set()
    if stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def _big_then_stop(put):
    """A generator target: set up, one batch of 40 MB, then frozen (SIGSTOP) as the catalogue froze one."""
    import os
    import signal

    put(None)
    put({"x": torch.arange(10_000_000, dtype=torch.float32)})
    time.sleep(1)  # the queue's feeder thread sends the message (a stop freezes every thread)
    os.kill(os.getpid(), signal.SIGSTOP)


def _descendants(pid: int) -> set[int]:
    """The live processes below `pid` (by each process's parent in /proc)."""
    import os

    parent = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] not in ("Z", "X"):
            parent[int(p)] = int(stat[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _descendants_alive(pids) -> set[int]:
    alive = set()
    for p in pids:
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                alive.add(p)
        except OSError:
            pass
    return alive


def _stderr_until(proc, marker: str, timeout: float) -> str:
    """proc's stderr read up to the line holding `marker` (at most `timeout` seconds); what was read."""
    import os
    import select

    got, deadline = "", time.time() + timeout  # the descriptor, not the text wrapper: nothing left in its buffer
    while marker not in got and time.time() < deadline:
        if select.select([proc.stderr.fileno()], [], [], 0.5)[0]:
            chunk = os.read(proc.stderr.fileno(), 65536).decode(errors="replace")
            if not chunk:
                break
            got += chunk
    return got


DYING_REWARD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from toy_reward import compute_score as toy

def compute_score(*a, **k):
    with open({calls!r}, "a") as f:  # calls counted across the reward pool's worker processes
        f.write(".")
    if os.path.getsize({calls!r}) > {after}:  # the 4th batch: kill (or freeze) the generator, the pool's parent
        {action}
    return toy(*a, **k)
"""


@pytest.mark.e2e  # (a few seconds: the fast tier stays under 5 minutes)
@pytest.mark.parametrize("route", ["shm", "broadcast"])
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_process_stopped_or_killed_holding_the_mailbox_lock_cannot_hang_the_trainer(route, how):
    """The trainer used to take the mailbox's lock with no timeout: a generator frozen (SIGSTOP) or killed while
    holding it hung the trainer for good and --generator-timeout never fired. Now every take is bounded: one
    GeneratorFailed within the timeout."""
    import multiprocessing as mp
    import os
    import signal

    m = torch.nn.Linear(2, 2)
    box = make_mailbox(route, m, version=0, loaded_for=5, ctx=_ctx(), timeout=30)
    fork = mp.get_context("fork")
    held = fork.Event()
    child = fork.Process(target=_hold_lock, args=(box.changed, held, how == "stopped"))
    child.start()
    try:
        assert held.wait(20)
        t0 = time.time()
        with pytest.raises(GeneratorFailed, match="lock stayed taken"):
            box.push(m, 1, 5, timeout=2, alive=lambda: True)  # the step is loaded: only the lock is in the way
        assert time.time() - t0 < 6
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join(10)


@pytest.mark.e2e
def test_batches_travel_whole_and_a_frozen_generator_is_bounded_by_the_timeout():
    """A batch of tens of MB arrives whole (through a file: a pipe message that large, cut by a writer frozen
    midway, would block the trainer's read past --generator-timeout); the generator then frozen by SIGSTOP ends the
    wait for the next batch at the timeout; stop() leaves no process and no batch file."""
    import os

    from common.integrations.async_generator import GeneratorProcess

    gen = GeneratorProcess(_big_then_stop, {}, max_ahead=2, threads=1, timeout=3)
    gen.start()
    assert torch.equal(gen.get()["x"], torch.arange(10_000_000, dtype=torch.float32))
    t0 = time.time()
    with pytest.raises(GeneratorFailed, match="no batch from the generator in 3 s"):
        gen.get()
    assert time.time() - t0 < 12
    spool = gen.spool
    gen.stop()
    assert not os.path.exists(spool)


@pytest.mark.e2e
def test_the_generator_does_not_outlive_a_killed_trainer(tmp_path):
    """A trainer killed by SIGKILL (no atexit, no handler): its generator process goes with it at once
    (PR_SET_PDEATHSIG), not after the orphan watcher's poll."""
    import os
    import signal
    import sys

    code = (f"import sys, time; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests' / 'helpers')!r}]\n"
            "from common.integrations.async_generator import GeneratorProcess\nfrom shared_async_grpo import _slow_to_start\n"
            "g = GeneratorProcess(_slow_to_start, dict(setup_s=0, then_hang=True), max_ahead=2, threads=1, timeout=60)\n"
            "g.start(); g.get(); print(g.proc.pid, flush=True); time.sleep(600)\n")  # fmt: skip
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(trainer.stdout.readline())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait(10)

    def gone():
        try:
            return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    t0 = time.time()
    while not gone() and time.time() - t0 < 10:
        time.sleep(0.05)
    assert gone() and time.time() - t0 < 1.5, time.time() - t0


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["SIGTERM", "double Ctrl-C"])
def test_a_stopped_trainer_takes_its_generator_and_the_generators_helpers_with_it(how, tiny_peaky, toy_prompts,
                                                                                  tmp_path):  # fmt: skip
    """async_grpo.py stopped after step 1, by SIGTERM (a scheduler's stop: the step finishes, then its checkpoint) or
    by Ctrl-C twice (the second one means "stop now": no checkpoint): it ends within seconds, with no traceback, and
    no process it started is left: the generator, its reward workers (--reward-workers 2) or their children."""
    import os
    import signal
    import sys

    flags = _flags(tiny_peaky, toy_prompts, tmp_path / "out", "--total-steps", 50, "--reward-workers", 2)
    trainer = subprocess.Popen([sys.executable, str(REPO / "algos/async_grpo.py"), *map(str, flags)], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "TOY_MODEL": tiny_peaky})  # fmt: skip
    try:
        for line in trainer.stdout:
            if line.startswith("step 1:"):
                break
        helpers = _descendants(trainer.pid)
        assert len(helpers) >= 3, helpers  # the generator and its 2 reward workers (at least)
        if how == "SIGTERM":
            trainer.send_signal(signal.SIGTERM)
        else:
            trainer.send_signal(signal.SIGINT)
            # the second once the first is handled (its line), before the step it asked to stop at ends and saves:
            # a fixed pause let the step end first on a loaded machine, or both land before the handler ran once
            first = _stderr_until(trainer, "[cleanrlhf] signal", timeout=30)
            trainer.send_signal(signal.SIGINT)
        t0 = time.time()
        out, err = trainer.communicate(timeout=120)
        err = (first if how != "SIGTERM" else "") + err
    finally:
        trainer.kill()
    assert trainer.returncode != 0 and time.time() - t0 < 60, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.time() + 5
    while _descendants_alive(helpers) and time.time() < deadline:
        time.sleep(0.1)
    assert not _descendants_alive(helpers), _descendants_alive(helpers)
    saved = list((only_run(tmp_path / "out") / "checkpoints").glob("step_*"))
    assert bool(saved) == (how == "SIGTERM"), (saved, err[-2000:])  # SIGTERM: the step it stopped, saved


@pytest.mark.e2e
def test_the_generator_timeout_counts_from_its_set_up_and_a_start_that_never_ends_is_bounded_too():
    """--generator-timeout bounds the wait for each batch once the generator is set up (a loaded machine's start
    took longer than a 20 s timeout in CI); its start is bounded by max(timeout, STARTUP_S)."""
    from common.integrations.async_generator import GeneratorProcess

    gen = GeneratorProcess(_slow_to_start, dict(setup_s=4, then_hang=True), max_ahead=2, threads=1, timeout=2)
    gen.start()
    assert gen.get() == {"x": 1}  # 4 s of setup > the 2 s timeout: allowed
    t0 = time.time()
    with pytest.raises(GeneratorFailed, match="no batch from the generator in 2 s"):
        gen.get()
    assert time.time() - t0 < 10
    never = GeneratorProcess(_slow_to_start, dict(setup_s=60, then_hang=False), max_ahead=2, threads=1, timeout=1)
    never.STARTUP_S = 3.0
    never.start()
    with pytest.raises(GeneratorFailed, match="the generator not set up in 3 s"):
        never.get()


@pytest.mark.e2e
def test_k0_reproduces_grpo_llm(tiny_peaky, toy_prompts, tmp_path):
    """K = 0 (the generator waits for each update) trains on exactly grpo_llm.py's batches: the same metrics for 3
    steps on float32, with the same --tis-cap (async_grpo's default 2, so pi_old is recomputed in both)."""
    env = {"TOY_MODEL": tiny_peaky}
    extra = ["--total-steps", 3, "--tis-cap", 2, "--kl-coef", 0.05]
    run_script("grpo_llm.py", *_flags(tiny_peaky, toy_prompts, tmp_path / "sync", *extra), env=env)
    run_script("async_grpo.py", *_flags(tiny_peaky, toy_prompts, tmp_path / "async", *extra),
               "--max-off-policy-steps", 0, env=env)  # fmt: skip
    sync, asy = read_metrics(only_run(tmp_path / "sync")), read_metrics(only_run(tmp_path / "async"))
    assert [r["async/staleness"] for r in asy] == [0, 0, 0]
    a, b = _strip(sync), _strip(asy)
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for ra, rb in zip(a, b):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (k, ra[k], rb[k])


@pytest.mark.e2e
def test_k1_is_one_update_behind_resumes_exactly_and_consumes_each_prompt_once(tiny_peaky, toy_prompts, tmp_path):
    """K = 1 over 9 steps of 2 prompts (32 prompts: epoch 1 is steps 1-16): staleness 0 then 1; a run stopped at
    its step-4 checkpoint (batches of steps 5 in hand) and resumed gives the same metrics; batches.jsonl lists each
    prompt once."""
    env = {"TOY_MODEL": tiny_peaky}
    flags = lambda out: _flags(tiny_peaky, toy_prompts, out, "--total-steps", 9, "--kl-coef", 0.05)
    run_script("async_grpo.py", *flags(tmp_path / "a"), "--save-every", 4, env=env)
    straight = only_run(tmp_path / "a")
    copy = tmp_path / "b" / straight.name
    shutil.copytree(straight, copy)
    # resumed with the other weight route: broadcast (gloo) must deliver exactly the weights shared memory did
    run_script("async_grpo.py", *flags(tmp_path / "b"), "--resume", copy / "checkpoints" / "step_4",
               "--weight-sync", "broadcast", env=env)  # fmt: skip
    a, b = read_metrics(straight), read_metrics(copy)
    assert [r["async/staleness"] for r in a] == [0] + [1] * 8 and a[-1]["async/staleness_max"] == 1
    assert _strip(a) == _strip(b) and [r["step"] for r in a] == list(range(1, 10))
    assert a[-1]["train/kl"] > 0 and all(0 <= r["async/trainer_idle_frac"] <= 1 for r in a)
    for run in (straight, copy):
        lines = [json.loads(x) for x in (run / "batches.jsonl").read_text().splitlines()]
        ids = [i for r in lines for i in r["prompt_ids"]]
        assert [r["step"] for r in lines] == list(range(1, 10)) and len(ids) == 18 == len(set(ids))
        assert json.loads((run / "staleness.json").read_text()) == {"0": 1, "1": 8}
    args = json.loads((straight / "args.json").read_text())
    assert args["old_logprobs_from"] == "trainer" and args["max_off_policy_steps"] == 1
    # as users chain runs: the checkpoint's policy folder as the model, K and the length from a --config preset
    (tmp_path / "preset.yaml").write_text("max_off_policy_steps: 2\ntotal_steps: 2\n")
    flags = _flags(str(copy / "checkpoints" / "step_9" / "policy"), toy_prompts, tmp_path / "c", "--kl-coef", 0.05)
    run_script("async_grpo.py", "--config", tmp_path / "preset.yaml", *flags, env=env)
    chained = only_run(tmp_path / "c")
    assert json.loads((chained / "args.json").read_text())["max_off_policy_steps"] == 2
    assert [r["async/staleness"] for r in read_metrics(chained)] == [0, 1]


@pytest.mark.e2e
def test_k1_learns_the_toy_task(tiny_peaky, toy_prompts, tmp_path):
    """15 iterations one update behind (K = 1, --tis-cap 2): the reward rises by more than 0.1, as grpo_llm's does."""
    run_script(
        "async_grpo.py", "--model-name-or-path", tiny_peaky, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD,
        "--output-dir", tmp_path, "--total-steps", 15, "--num-prompts", 8, "--group-size", 4, "--mini-batch-size", 16,
        "--micro-batch-size", 16, "--max-new-tokens", 6, "--learning-rate", 3e-3, "--update-epochs", 2,
        "--eval-every", 0, env={"TOY_MODEL": tiny_peaky},
    )  # fmt: skip
    rows = read_metrics(only_run(tmp_path))
    rewards = [r["train/reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(r["async/staleness"] == min(r["step"] - 1, 1) for r in rows)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["killed", "hangs", "raises"])
def test_a_generator_that_dies_or_hangs_ends_the_run_with_one_line_and_a_checkpoint(how, tiny_peaky, toy_prompts,
                                                                                     tmp_path):  # fmt: skip
    """The reward function (run by the generator's pool of reward workers) kills the generator (as the out-of-memory
    killer would), freezes it (SIGSTOP) or raises in its 4th batch: the run exits 1 within --generator-timeout with one
    line, the checkpoint of the last step trained is written, and the run resumes from it to the end."""
    action = {"killed": "os.kill(os.getppid(), signal.SIGKILL)", "hangs": "os.kill(os.getppid(), signal.SIGSTOP)",
              "raises": "raise ValueError('a bug in the reward')"}[how]  # fmt: skip
    bad = DYING_REWARD.format(
        tests=str(REPO / "tests" / "helpers"), calls=str(tmp_path / "calls"), after=3 * 8, action=action
    )
    (tmp_path / "bad.py").write_text(bad)
    # (the 20 s count once the generator is set up: its start, slower on a loaded machine, is not in them)
    flags = _flags(tiny_peaky, toy_prompts, tmp_path / "out", "--total-steps", 5, "--generator-timeout", 20)
    flags[flags.index(TOY_REWARD)] = f"{tmp_path}/bad.py:compute_score"
    t0 = time.time()
    proc = run_script("async_grpo.py", *flags, env={"TOY_MODEL": tiny_peaky}, check=False)
    assert proc.returncode == 1 and time.time() - t0 < 200, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("[cleanrlhf] step")]
    want = {"killed": "died with exit code -9 (killed: out of memory?)", "hangs": "no batch from the generator in 20 s",
            "raises": "the generator raised RewardError"}[how]  # fmt: skip
    assert len(line) == 1 and want in line[0] and "resume with --resume" in line[0], proc.stderr[-2000:]
    run = only_run(tmp_path / "out")
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert steps[-1] == 3 == len(read_metrics(run))  # the last step trained is saved
    if how == "raises":  # its traceback, in the run folder
        assert "ValueError('a bug in the reward')" in (run / "generator_error_rank0.txt").read_text()
    if how == "killed":  # the reward file fixed (the same flags: a resume refuses others): runs to the end
        (tmp_path / "bad.py").write_text(bad.replace(f"> {3 * 8}:", "> 10**9:"))
        run_script("async_grpo.py", *flags, "--resume", run, env={"TOY_MODEL": tiny_peaky})
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]


@pytest.mark.e2e
def test_flags_it_refuses_are_one_line():
    proc = run_script("async_grpo.py", "--max-off-policy-steps", -1, timeout=120, check=False)
    assert proc.returncode == 2 and "--max-off-policy-steps" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.e2e
def test_multi_turn_environment_in_the_generator_process(tiny_agent, toy_prompts, tmp_path):
    """--env feedback runs in the generator process (K = 1): turns, the environment's metrics and the sampled ids
    come back with the batch; with staleness 0 on step 1 the trainer scores exactly what was sampled."""
    flags = [
        "--model-name-or-path", tiny_agent, "--train-files", toy_prompts, "--reward-fn", TOY_REWARD,
        "--output-dir", tmp_path, "--env", "feedback", "--max-turns", 3, "--max-new-tokens", 40,
        "--max-trajectory-tokens", 160, "--num-prompts", 4, "--group-size", 2, "--mini-batch-size", 8,
        "--micro-batch-size", 4, "--learning-rate", 3e-3, "--eval-every", 0, "--total-steps", 2,
    ]  # fmt: skip
    run_script("async_grpo.py", *flags, env={"TOY_MODEL": tiny_agent})
    rows = read_metrics(only_run(tmp_path))
    assert rows[0]["env/turns"] > 1 and all("env/solved_turn" in r and "env/obs_frac" in r for r in rows)
    assert rows[0]["train/sampler_logprob_diff"] < 1e-4 and [r["async/staleness"] for r in rows] == [0, 1]
