"""algos/async_grpo.py: the weight mailbox's ordering, the batches a checkpoint keeps, K = 0 equals grpo_llm.py,
K = 1 samples one update behind, resumes exactly with every prompt consumed once, learns the toy task, and a
generator that dies or hangs ends the run in one line with a checkpoint."""

import subprocess
import threading
import time

import pytest
import torch

from common.core.errors import UserError
from common.integrations.async_generator import BatchStream, GeneratorFailed, generator_env, split_threads
from common.integrations.weight_mailbox import make_mailbox
from conftest import REPO
from shared_async_grpo import _ctx


class _FakeAccelerator:
    num_processes, process_index, is_main_process = 1, 0, True


def _rollout(step, rows=("not saved", "not saved")):
    from common.core.sampling import Rollout

    x, z = torch.full((2,), float(step)), torch.zeros(2, dtype=torch.bool)
    return Rollout(rows=list(rows), texts=["a", "b"], queries=torch.ones(2, 3, dtype=torch.long),
                   query_mask=torch.ones(2, 3), responses=torch.ones(2, 4, dtype=torch.long), mask=torch.ones(2, 4),
                   logprobs=torch.zeros(2, 4), is_eos=~z, truncated=z, scores=x, solved=x, logged={"reward/rule": x},
                   prompt_cache="not saved")  # fmt: skip


class _FakeGenerator:
    """Hands out the batches of steps `first_step`, ... (what GeneratorProcess.get returns); dies after `n`."""

    def __init__(self, n=100):
        self.n, self.given = n, 0

    def start(self, first_step, sampler_state):
        self.step, self.sampler_state = first_step, sampler_state

    def get(self, what=""):
        if self.given == self.n:
            raise GeneratorFailed("the generator process died with exit code -9 (killed: out of memory?)")
        b = {"step": self.step, "prompt_ids": [self.step, self.step], "rollout": _rollout(self.step),
             "sampler": {"epoch": 0, "pos": self.step}}  # fmt: skip
        self.step, self.given = self.step + 1, self.given + 1
        return b


@pytest.mark.parametrize("route", ["shm", "broadcast"])
def test_mailbox_push_waits_until_the_generator_loaded_the_last_step_of_the_old_version(route):
    """Both --weight-sync routes (broadcast: gloo between this thread and the sender thread) keep one contract."""
    trainer, gen = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    box = make_mailbox(route, trainer, version=0, loaded_for=0, ctx=_ctx(), timeout=30)
    v0 = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    with torch.no_grad():
        trainer.weight.fill_(1.0)
    pushed = []
    t = threading.Thread(target=lambda: pushed.append(box.push(trainer, 1, 2, timeout=30, alive=lambda: True)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and box.version.value == 0  # waits: step 2's batch needs version 0 and is not loaded yet
    assert box.load_into(gen, needed=0, step=1, have=None, timeout=5) == 0
    assert torch.equal(gen.weight, v0["weight"]) and torch.equal(gen.bias, v0["bias"])
    assert not torch.equal(gen.weight, trainer.weight)
    time.sleep(0.2)
    assert t.is_alive()  # step 1 loaded, step 2 not yet
    assert box.load_into(gen, needed=0, step=2, have=0, timeout=5) == 0  # holds version 0 already: no copy
    t.join(5)
    assert not t.is_alive() and box.version.value == 1 and pushed[0] >= 0.4
    assert box.load_into(gen, needed=1, step=3, have=0, timeout=5) == 1 and torch.equal(gen.weight, trainer.weight)


@pytest.mark.parametrize("route", ["shm", "broadcast"])
def test_mailbox_timeouts_and_a_dead_generator_raise_instead_of_hanging(route):
    m = torch.nn.Linear(2, 2)
    box = make_mailbox(route, m, version=0, loaded_for=0, ctx=_ctx(), timeout=30)
    with pytest.raises(GeneratorFailed, match="died"):
        box.push(m, 1, 5, timeout=30, alive=lambda: False)
    with pytest.raises(GeneratorFailed, match="did not reach step 5"):
        box.push(m, 1, 5, timeout=0.5, alive=lambda: True)
    with pytest.raises(GeneratorFailed, match="no weights version 3"):
        box.load_into(m, needed=3, step=4, have=0, timeout=0.5)


def test_generator_device_picks_the_generators_gpu_and_refuses_what_nccl_cannot(monkeypatch):
    """--generator-device as CUDA_VISIBLE_DEVICES of the generator process (counted in the trainer's visible GPUs);
    broadcast over NCCL needs the generator on another GPU. The CPU tests' trainer on "cpu" changes nothing."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rank1 = torch.device("cuda", 1)
    got = {spec: generator_env(rank1, spec, "shm")["CUDA_VISIBLE_DEVICES"] for spec in ("", "+2", "cuda:3", "cpu")}
    assert got == {"": "1", "+2": "3", "cuda:3": "3", "cpu": ""}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert generator_env(rank1, "+1", "broadcast") == {"CUDA_VISIBLE_DEVICES": "6"}
    for spec, says in [("", "trainer's own GPU"), ("+3", "no such GPU"), ("gpu1", r"expected cpu, cuda:N or \+N"),
                       ("cpu", "NCCL sends GPU to GPU")]:  # fmt: skip
        with pytest.raises(UserError, match=says):
            generator_env(rank1, spec, "broadcast")
    assert generator_env(torch.device("cpu"), "", "broadcast") == {}
    with pytest.raises(UserError, match="can only use the CPU"):
        generator_env(torch.device("cpu"), "cuda:0", "shm")


def test_a_dev_shm_too_small_for_the_mailbox_is_one_line_saying_what_to_do(monkeypatch):
    def full(self):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2>: Success (0)")

    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    with pytest.raises(UserError, match=r"--weight-sync shm: the weight mailbox needs 0.00 GB .*--shm-size .*"
                                        r"--weight-sync broadcast"):  # fmt: skip
        make_mailbox("shm", torch.nn.Linear(2, 2), 0, 0, 30, ctx=_ctx())


def test_a_checkpoint_keeps_the_next_k_batches_without_their_rows_and_restores_them():
    import io

    rows = [f"row {i}" for i in range(10)]
    stream = BatchStream(_FakeAccelerator(), ahead=2, total_steps=6, train_rows=rows)
    stream.start(_FakeGenerator(), next_step=1, sampler_state={"epoch": 0, "pos": 0})
    assert stream.next(1)["step"] == 1
    buf = io.BytesIO()
    torch.save(stream.state_dict(), buf)  # after step 1: steps 2 and 3 (sampled by versions <= 1)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # as checkpoints load: tensors, numbers, strings only
    assert sorted(state["ranks"][0]) == [2, 3] and {"rows", "prompt_cache"}.isdisjoint(state["ranks"][0][2]["rollout"])
    resumed = BatchStream(_FakeAccelerator(), ahead=2, total_steps=6, train_rows=rows)
    resumed.load_state_dict(state)
    gen = _FakeGenerator()
    resumed.start(gen, next_step=2, sampler_state={"epoch": 0, "pos": 1})
    assert gen.step == 4 and gen.sampler_state == {"pos": 3, "epoch": 0}  # after the last batch held
    b2, b3, b4 = resumed.next(2), resumed.next(3), resumed.next(4)
    assert b2["rollout"].rows == ["row 2", "row 2"] and b4["step"] == 4 and b3["rollout"].prompt_cache is None
    assert torch.equal(b3["rollout"].scores, torch.full((2,), 3.0)) and b3["rollout"].logged["reward/rule"][0] == 3
    # a checkpoint written before the Rollout (its fields flat in the batch) resumes the same
    flat = {k: v for k, v in vars(_rollout(7)).items() if k not in ("rows", "prompt_cache", "is_eos", "logged")}
    old = dict(flat, step=7, prompt_ids=[1, 2], sampler={}, **{"reward/rule": flat["scores"]})
    before = BatchStream(_FakeAccelerator(), ahead=2, total_steps=8, train_rows=rows)
    before.load_state_dict({"ranks": [{7: old}]})
    r7 = before.ready[7]["rollout"]
    assert r7.rows == ["row 1", "row 2"] and r7.is_eos.all() and r7.logged["reward/rule"].tolist() == [7.0, 7.0]
    assert r7.texts == ["a", "b"] and r7.query_responses.shape == (2, 7) and "reward/rule" not in before.ready[7]
    # near the end: only the steps that exist; a dead generator: saved without the batches it never sent
    assert sorted(resumed.state_dict()["ranks"][0]) == [5, 6]
    dying = BatchStream(_FakeAccelerator(), ahead=2, total_steps=6, train_rows=rows)
    dying.start(_FakeGenerator(n=2), next_step=1, sampler_state={})
    dying.next(1)
    assert sorted(dying.state_dict()["ranks"][0]) == [2] and dying.failed is not None


def test_thread_split():
    cores = torch.get_num_threads()  # OMP_NUM_THREADS where set
    assert split_threads(0, -1) == (cores, cores)  # synchronous: one side works at a time
    assert split_threads(1, -1) == (max(1, cores - max(1, cores // 2)), max(1, cores // 2))
    assert split_threads(2, 1) == (max(1, cores - 1), 1)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 leaves it: the budget, not the machine's cores
    try:
        assert split_threads(0, -1) == (1, 1) and split_threads(1, -1) == (1, 1)
    finally:
        torch.set_num_threads(cores)


def test_diff_against_grpo_stays_small():
    out = subprocess.run(
        ["diff", str(REPO / "algos/grpo_llm.py"), str(REPO / "algos/async_grpo.py")], capture_output=True, text=True
    ).stdout
    changed = [line for line in out.splitlines() if line[:1] in "<>"]
    assert 0 < len(changed) <= 200, len(changed)  # the idea: generator, weight push, staleness (issue 50)
