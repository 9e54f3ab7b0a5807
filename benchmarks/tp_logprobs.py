"""Log-probs under tensor parallelism: the LM head's logits gathered on every rank (transformers' plan)
vs kept split over the vocabulary (common.parallel.sharded_logits, what the scripts use). One row per mode:
seconds per forward + backward of `forward_logprobs` (policy log-probs and entropy, as in an update) and
how much each rank's peak RSS grew over the model's own (ru_maxrss after loading vs after the steps).
Each mode runs in fresh processes; run it alone on the machine.

    python benchmarks/tp_logprobs.py                     # SmolLM2-135M, --tp-size 3 (9 heads), 8 x 128 tokens
    python benchmarks/tp_logprobs.py --model PATH --tp-size 2 --batch 4 --tokens 64
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(a) -> None:
    """Under torchrun: one mode, printing rank 0's numbers as a JSON line."""
    import torch

    from common.core import models
    from common.core import process_groups as parallel
    from common.core.forwards import forward_logprobs
    from common.parallel.accelerator import make_accelerator

    acc = make_accelerator(tp_size=a.tp_size)
    model = models.load_causal_lm(a.model, dtype="float32")
    if a.mode == "gathered":
        parallel.STATE.tp_group = None  # sharded_logits() is then a no-op: the head gathers (B, T, V)
    g = torch.Generator().manual_seed(0)
    qr = torch.randint(0, 1000, (a.batch, 2 * a.tokens), generator=g)
    attn = torch.ones_like(qr)
    base, times = rss_gb(), []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        lp, ent = forward_logprobs(model, qr, attn, P=a.tokens, with_entropy=True)
        lp.sum().backward()
        times.append(time.perf_counter() - t0)
    if acc.state.process_index == 0:
        V = model.config.vocab_size
        logits_gb = a.batch * (a.tokens + 1) * V * 4 / 2**30 / (a.tp_size if a.mode == "sharded" else 1)
        row = {"mode": a.mode, "s": statistics.median(times[1:]), "rss_growth_gb": rss_gb() - base}
        print("ROW " + json.dumps({**row, "logits_gb_per_rank": logits_gb}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=models_default())
    p.add_argument("--tp-size", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128, help="prompt and response length each")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["gathered", "sharded"], help="(internal) the mode a torchrun worker runs")
    a = p.parse_args()
    if a.mode:
        return worker(a)
    rows = []
    for mode in ("gathered", "sharded"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.tp_size)]
        cmd += [__file__, "--mode", mode, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
        if line is None:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(line[4:]))
    print(f"\n{a.model}: --tp-size {a.tp_size}, {a.batch} x ({a.tokens} + {a.tokens}) tokens, fp32, rank 0")
    print("| logits | s per fwd+bwd (median) | rank 0 peak RSS growth | (B, T+1, V) fp32 logits per rank |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['s']:.2f} | {r['rss_growth_gb']:.2f} GB | {r['logits_gb_per_rank']:.2f} GB |")


def models_default() -> str:
    from common.core.defaults import DEFAULT_MODEL

    return DEFAULT_MODEL


if __name__ == "__main__":
    main()
