"""The two weight routes of async_grpo.py (--weight-sync shm | broadcast) on this machine, SmolLM2-135M-Instruct's
trainable tensors (full fine-tuning): the trainer's push (its copy into shared memory / the staging buffers) and the
generator's load (copy out / the broadcast received), medians over `--versions` pushes. On CPU the broadcast is gloo
over loopback TCP; on a GPU it is NCCL (benchmarks/gpu_check.sh runs it there). Run it alone on the machine.

    python benchmarks/weight_sync.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def generator(mailbox, model_path: str, versions: int, out) -> None:
    from common.core import chat
    from common.core import models as M

    model = M.load_causal_lm(model_path, chat.load_tokenizer(model_path))
    have, times = None, []
    for v in range(versions + 1):
        t0 = time.time()
        have = mailbox.load_into(model, needed=v, step=v + 1, have=have, timeout=300)
        times.append(time.time() - t0)
    out.put(times[1:])  # the first load (version 0) includes joining the group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=10)
    args = p.parse_args()
    import torch

    from common.core import chat, defaults, hub
    from common.core import models as M
    from common.integrations.async_generator import GeneratorProcess
    from common.integrations.weight_mailbox import make_mailbox, trainable_tensors

    path = hub.resolve_model_path(defaults.DEFAULT_MODEL)
    model = M.load_causal_lm(path, chat.load_tokenizer(path))
    mb = sum(t.numel() * t.element_size() for t in trainable_tensors(model).values()) / 2**20
    print(
        f"{defaults.DEFAULT_MODEL}: {mb:.0f} MiB of trainable tensors per push; torch threads {torch.get_num_threads()}"
    )
    print("| route | push_s (trainer) | load_s (generator, waits for the push included) |\n|---|---|---|")
    ctx = GeneratorProcess.context()
    for route in ("shm", "broadcast"):
        box = make_mailbox(route, model, 0, 0, ctx, 300.0)
        out = ctx.Queue()
        proc = ctx.Process(target=generator, args=(box, path, args.versions, out))
        proc.start()
        pushes = []
        for v in range(1, args.versions + 1):
            with torch.no_grad():
                next(iter(trainable_tensors(model).values())).add_(1e-3)  # a new version
            t0 = time.time()
            box.push(model, v, after_step=v, timeout=300, alive=proc.is_alive)
            pushes.append(time.time() - t0)
        loads = out.get(timeout=600)
        proc.join(60)
        print(f"| {route} | {statistics.median(pushes):.3f} | {statistics.median(loads):.3f} |", flush=True)


if __name__ == "__main__":
    main()
