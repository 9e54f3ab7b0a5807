"""Gathered vs sharded checkpoints (--checkpoint-format full | sharded) under FSDP2: seconds to save and to load
(resume), and the host memory each process adds while doing it, on SmolLM2-135M-Instruct with AdamW state after
one step. Launch it with the processes to measure (it prints one table, from rank 0):

    accelerate launch --config_file configs/accelerate/cpu_2proc_fsdp2.yaml benchmarks/checkpoint_io.py
    accelerate launch --config_file configs/accelerate/cpu_2proc_fsdp2.yaml --num_processes 3
    benchmarks/checkpoint_io.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PeakRSS:
    """The most resident memory this process held between start and stop, sampled every 10 ms (GB above start)."""

    def __enter__(self):
        self.base, self.peak, self.run = self.rss(), 0.0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def rss() -> float:
        import os

        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    def sample(self):
        while self.run:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.01)

    def __exit__(self, *exc):
        self.run = False
        self.thread.join()
        self.peak = max(self.peak, self.rss()) - self.base


def main() -> None:
    import torch

    from common.core import chat, defaults, hub
    from common.core import models as M
    from common.harness import checkpoint as C
    from common.harness.args import ModelArgs
    from common.parallel.accelerator import make_accelerator

    acc = make_accelerator(ModelArgs())
    path = hub.resolve_model_path(defaults.DEFAULT_MODEL)
    tok = chat.load_tokenizer(path)
    model = M.load_causal_lm(path, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model, opt = acc.prepare(model, opt)
    model(input_ids=torch.tensor([[1, 2, 3, 4]] * 2)).logits.float().mean().backward()
    opt.step()
    root = Path(tempfile.mkdtemp(prefix="ckpt_io_")) if acc.is_main_process else None
    from accelerate.utils import broadcast_object_list

    root = Path(broadcast_object_list([str(root) if root else None], from_process=0)[0])
    rows = []
    for fmt in ("full", "sharded"):
        run = root / fmt
        acc.wait_for_everyone()
        with PeakRSS() as mem_save:
            t0 = time.time()
            C.save_checkpoint(acc, run, 1, {"policy": model}, {}, tokenizer=tok, optimizers={"opt": ("policy", opt)},
                              sharded=fmt == "sharded")  # fmt: skip
            save_s = time.time() - t0
        acc.wait_for_everyone()
        ckpt = run / "checkpoints" / "step_1"
        with PeakRSS() as mem_load:
            t0 = time.time()
            if fmt == "full":  # what --resume does: weights (every process reads the whole file), then the optimizer
                C.load_weights(acc.unwrap_model(model), ckpt / "policy")
            C.restore_checkpoint(acc, ckpt, {"policy": model}, {}, {"opt": ("policy", opt)})
            load_s = time.time() - t0
        gathered = torch.tensor([mem_save.peak, mem_load.peak])
        gathered = acc.gather(gathered[None]).max(0).values  # the largest over the processes
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30
        rows.append((fmt, save_s, load_s, gathered[0].item(), gathered[1].item(), size))
    if acc.is_main_process:
        print(f"\n{acc.num_processes} processes, FSDP2, {defaults.DEFAULT_MODEL} + AdamW state")
        print("| format | save s | load s | host memory added, save (GB, max over processes) | load | files GB |")
        print("|---|---|---|---|---|---|")
        for fmt, s, lo, ms, ml, size in rows:
            print(f"| {fmt} | {s:.2f} | {lo:.2f} | {ms:.2f} | {ml:.2f} | {size:.2f} |")
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
