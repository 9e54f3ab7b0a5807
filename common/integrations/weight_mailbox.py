"""The weights async GRPO's generator samples with (docs/async.md): `WeightMailbox` (--weight-sync shm: shared
CPU memory under one lock) and `BroadcastMailbox` (--weight-sync broadcast: a collective in a group of two), one
contract: a batch is sampled by exactly the version its step asks for.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
import time

import torch


class GeneratorFailed(RuntimeError):
    """The generator process raised, died or timed out; the message is one line saying which."""


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """What a push carries: the tensors that training changes (all parameters; under LoRA the adapters). The frozen
    rest is loaded by the generator from the same files as the trainer's."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _locked(lock, timeout: float, timed_out: str, ready=lambda: True, alive=lambda: True):
    """Hold the mailbox's `lock` (shared with the other process) once ready(), polled every 50 ms; GeneratorFailed
    if the generator died (alive() false) or after `timeout` seconds in all (`timed_out` says what). The lock too is
    taken with that timeout: a process stopped (SIGSTOP) or killed while it holds the lock cannot hang this one
    (a plain `with lock` would wait forever, and --generator-timeout never fire)."""
    t0 = time.time()
    while True:
        left = max(timeout - (time.time() - t0), 0.0)
        if not lock.acquire(timeout=max(left, 0.05)):
            raise GeneratorFailed(f"{timed_out}: the weight mailbox's lock stayed taken (a stopped or killed process)")
        try:
            if ready():
                yield
                return
        finally:
            lock.release()
        if not alive():  # (checked while waiting only, as before: a ready mailbox needs no generator)
            raise GeneratorFailed("the generator process died before loading the weights it needed")
        if time.time() - t0 > timeout:
            raise GeneratorFailed(timed_out)
        time.sleep(0.05)


class WeightMailbox:
    """One version of the policy's trainable weights in shared CPU memory, with its version number.
    Made by the trainer, handed to the generator process (it pickles as shared-memory handles)."""

    def __init__(self, model, version: int, loaded_for: int, ctx):
        try:
            self.buffers = {n: t.detach().to("cpu", torch.float32, copy=True).share_memory_()
                            for n, t in trainable_tensors(model).items()}  # fmt: skip
        except RuntimeError as e:  # "unable to allocate shared memory(shm) for file ...": /dev/shm is too small
            if "shared memory" not in str(e):
                raise
            from common.core.errors import UserError

            need = sum(t.numel() for t in trainable_tensors(model).values()) * 4 / 2**30
            shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
            free = f"; /dev/shm has {shm.f_bavail * shm.f_frsize / 2**30:.2f} GB free" if shm else ""
            raise UserError(f"--weight-sync shm: the weight mailbox needs {need:.2f} GB of shared memory{free}: give "
                            f"/dev/shm more (docker run --shm-size {math.ceil(need * 1.5 + 1)}g) or use --weight-sync "
                            "broadcast (no shared memory)") from None  # fmt: skip
        # the version in the buffers; the last step whose batch the generator loaded weights for
        # the shared values have no lock of their own (that one would be taken without a timeout): they are read
        # and written under `changed`'s
        self.version, self.loaded_for = ctx.Value("q", version, lock=False), ctx.Value("q", loaded_for, lock=False)
        self.changed = ctx.Condition()

    def push(self, model, version: int, after_step: int, timeout: float, alive) -> float:
        """Trainer side: copy `model`'s trainable weights in as `version`, once the generator has loaded weights
        for the batch of `after_step` (the last batch the version in the buffers is for). Returns the seconds
        spent, waiting included."""
        t0 = time.time()
        with _locked(self.changed, timeout, f"the generator did not reach step {after_step} in {timeout:g} s",
                     lambda: self.loaded_for.value >= after_step, alive):  # fmt: skip
            with torch.no_grad():
                for n, t in trainable_tensors(model).items():
                    self.buffers[n].copy_(t.detach())
            self.version.value = version
            self.changed.notify_all()
        return time.time() - t0

    def load_into(self, model, needed: int, step: int, have: int | None, timeout: float) -> int:
        """Generator side, before sampling the batch of `step`: wait until a version >= `needed` is in, copy it
        into `model` unless `model` already holds it (`have`), return the version."""
        with _locked(self.changed, timeout, f"no weights version {needed} from the trainer in {timeout:g} s",
                     lambda: self.version.value >= needed):  # fmt: skip
            version = self.version.value
            if version != have:
                with torch.no_grad():
                    params = trainable_tensors(model)
                    for n, buf in self.buffers.items():
                        params[n].copy_(buf)
            self.loaded_for.value = step
            self.changed.notify_all()
        return version


class BroadcastMailbox:
    """WeightMailbox's contract (push / load_into, the same waits), the weights sent by a broadcast from the trainer
    to its generator in a process group of the two: NCCL when the trainer is on a GPU (the generator must be on
    another GPU: NCCL joins one process per device; --generator-device), gloo on CPU. The trainer copies its
    trainable tensors into one flat staging buffer per dtype on its device (`push`, under the lock: no half push);
    a sender thread broadcasts the buffers when the generator asks for the version in them (`load_into`); the
    trainer trains on meanwhile, and only overwrites the buffers once the generator has received them.

    Why by hand: torch.distributed's default group is the trainers' own (DDP); the generator is outside it, so the
    pair gets a group of its own from a TCPStore (what vLLM's StatelessProcessGroup does)."""

    def __init__(self, model, version: int, loaded_for: int, ctx, timeout: float = 900.0):
        self.version, self.loaded_for = ctx.Value("q", version, lock=False), ctx.Value("q", loaded_for, lock=False)
        self.wanted, self.changed = ctx.Value("q", -1, lock=False), ctx.Condition()  # the version the generator wants
        self.timeout = datetime.timedelta(seconds=timeout)
        self._store = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, timeout=self.timeout, wait_for_workers=False)
        self.port, tensors = self._store.port, trainable_tensors(model)
        self.cuda = next(iter(tensors.values())).device.type == "cuda"
        self.layout = self._layout(tensors)  # [(name, dtype, offset, numel, shape)], the same on both sides
        self._staging = self._buffers(next(iter(tensors.values())).device)
        self._copy(tensors, into_staging=True)
        self._sending = threading.Lock()
        self._sender = threading.Thread(target=self._send_loop, args=(next(iter(tensors.values())).device,),
                                        daemon=True)  # fmt: skip
        self._sender.start()

    def __getstate__(self):  # what the generator process gets: the shared values, the port, the layout
        keep = ("version", "loaded_for", "wanted", "changed", "timeout", "port", "cuda", "layout")
        return {k: self.__dict__[k] for k in keep}

    @staticmethod
    def _layout(tensors) -> list[tuple]:
        offsets, out = {}, []
        for n, t in tensors.items():
            out.append((n, t.dtype, offsets.get(t.dtype, 0), t.numel(), tuple(t.shape)))
            offsets[t.dtype] = offsets.get(t.dtype, 0) + t.numel()
        return out

    def _buffers(self, device) -> dict:
        sizes = {}
        for _, dtype, off, numel, _ in self.layout:
            sizes[dtype] = max(sizes.get(dtype, 0), off + numel)
        return {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}

    def _copy(self, tensors, into_staging: bool, buffers=None) -> None:
        buffers = self._staging if buffers is None else buffers
        with torch.no_grad():
            for name, dtype, off, numel, shape in self.layout:
                flat = buffers[dtype][off : off + numel].view(shape)
                (flat if into_staging else tensors[name]).copy_(tensors[name] if into_staging else flat)

    def _group(self, store, rank: int):
        """The pair's process group (rank 0: the trainer)."""
        store = torch.distributed.PrefixStore("weights", store)
        if self.cuda:
            options = torch.distributed.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            return torch.distributed.ProcessGroupNCCL(store, rank, 2, options)
        return torch.distributed.ProcessGroupGloo(store, rank, 2, self.timeout)

    def _broadcast(self, group, buffers) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for dtype in sorted(buffers, key=str):
            group.broadcast([buffers[dtype]], options).wait()
        if self.cuda:
            torch.cuda.synchronize()

    def _send_loop(self, device) -> None:
        """Trainer side, a thread: join the pair's group, then broadcast the staging buffers whenever the generator
        asks for a version it has not had. A failed send (the generator died) ends the thread; the trainer's waits
        then see the generator gone or time out."""
        if self.cuda:
            torch.cuda.set_device(device)
        try:
            group, sent = self._group(self._store, 0), -1
            while True:
                with self.changed:
                    if self.wanted.value <= sent:
                        self.changed.wait(0.5)
                        continue
                    want = self.wanted.value
                with self._sending:  # the buffers hold `want`: push() cannot overwrite them before it is received
                    self._broadcast(group, self._staging)
                sent = want
        except Exception:  # noqa: BLE001 -- the generator died mid-send: its death is reported by the trainer's waits
            return

    def push(self, model, version: int, after_step: int, timeout: float, alive) -> float:
        """Trainer side: as WeightMailbox.push, into the staging buffers."""
        t0 = time.time()
        with _locked(self.changed, timeout, f"the generator did not reach step {after_step} in {timeout:g} s",
                     lambda: self.loaded_for.value >= after_step, alive):  # fmt: skip
            with self._sending:
                self._copy(trainable_tensors(model), into_staging=True)
                if self.cuda:
                    torch.cuda.synchronize()
            self.version.value = version
            self.changed.notify_all()
        return time.time() - t0

    def load_into(self, model, needed: int, step: int, have: int | None, timeout: float) -> int:
        """Generator side: as WeightMailbox.load_into, receiving the version by broadcast (the first call joins the
        pair's group)."""
        params = trainable_tensors(model)
        if not hasattr(self, "_group_"):
            store = torch.distributed.TCPStore("127.0.0.1", self.port, 2, False, timeout=self.timeout)
            self._group_, self._recv = self._group(store, 1), self._buffers(next(iter(params.values())).device)
        with _locked(self.changed, timeout, f"no weights version {needed} from the trainer in {timeout:g} s",
                     lambda: self.version.value >= needed):  # fmt: skip
            version = self.version.value
            if version != have:
                self.wanted.value = version
                self.changed.notify_all()
        if version != have:  # outside the lock: the sender thread takes it to see what is wanted
            self._broadcast(self._group_, self._recv)
            self._copy(params, into_staging=False, buffers=self._recv)
        with _locked(self.changed, timeout, f"the weight mailbox's lock, after receiving version {version}"):
            self.loaded_for.value = step
            self.changed.notify_all()
        return version


def make_mailbox(route: str, model, version: int, loaded_for: int, timeout: float, ctx=None):
    """--weight-sync: "shm" (WeightMailbox) or "broadcast" (BroadcastMailbox); ctx: GeneratorProcess.context()'s."""
    ctx = ctx or torch.multiprocessing.get_context("spawn")  # as GeneratorProcess.context()
    if route == "broadcast":
        return BroadcastMailbox(model, version, loaded_for, ctx, timeout)
    return WeightMailbox(model, version, loaded_for, ctx)
