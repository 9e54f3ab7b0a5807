"""Per-rank memory of a weight push under FSDP2 (issue 64, item 1): 2 CPU processes over gloo, a random ~0.45B
Qwen-sized model (vocabulary 151,936, hidden 1024, 12 layers, untied head), sharded with fully_shard. Two routes:

  streamed  common.parallel.weight_stream.engine_weights(model, bfloat16): one parameter gathered at a time, in the
  engine's
            dtype, freed before the next (what the vLLM engines push now);
  streamed, held: the same, consumed as vLLM's load_weights loop does (its loop variable still holds one tensor
            while the next is gathered: two of the largest at once where the embedding and the head follow each other);
  gathered  the route before 09a9096: the whole state dict's full_tensor() in float32, held at once.

The consumer copies each tensor into the engine's weights (allocated before the push, as an engine's are). Extra memory
is the peak resident set size while pushing minus the size before (sampled every millisecond), per rank. Run it alone:

    python benchmarks/fsdp2_push_memory.py     # starts its two processes (torch.distributed.run)

Prints a markdown table (docs/distributed.md quotes it)."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_during(fn) -> tuple[int, float]:
    """(peak RSS during fn() minus RSS before, seconds fn took)."""
    base, peak, running = rss(), [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample)
    thread.start()
    t0 = time.time()
    fn()
    took = time.time() - t0
    running[0] = False
    thread.join()
    return max(peak[0], rss()) - base, took


def rank_main():
    import ctypes

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.parallel.weight_stream import engine_weights

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    checks = {}

    # the engine's own weights (allocated before the push, as vLLM's are): each streamed tensor is copied in
    engine = {k: torch.empty(v.shape, dtype=torch.bfloat16).fill_(0) for k, v in model.state_dict().items()}  # resident

    def streamed():  # a consumer that drops each tensor once copied
        for name, t in engine_weights(model, torch.bfloat16):
            engine[name].copy_(t)
            del t

    def streamed_held():  # vLLM's load_weights loop: its loop variable holds a tensor while the next is gathered
        for name, t in engine_weights(model, torch.bfloat16):
            engine[name].copy_(t)

    def gathered():
        full = {k: v.full_tensor().float() for k, v in model.state_dict().items()}
        checks["gathered"] = sum(float(t.sum()) for t in full.values())
        del full

    rows = []
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for name, fn in (("streamed", streamed), ("streamed, held", streamed_held), ("gathered", gathered)):
        dist.barrier()
        extra, took = peak_during(fn)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        rows.append((name, extra, took))
    checks["streamed"] = sum(float(t.float().sum()) for t in engine.values())
    out = [None, None]
    dist.all_gather_object(out, rows)
    if rank == 0:
        bf16_largest = largest * 2
        print(f"{n_params / 1e9:.2f}B parameters, largest {largest / 1e6:.1f}M ({bf16_largest / 2**20:.0f} MiB in "
              f"bf16); the model in bf16 {n_params * 2 / 2**30:.2f} GiB, in float32 {n_params * 4 / 2**30:.2f} GiB")  # fmt: skip
        print("| route | rank | extra memory during the push | × largest parameter (bf16) | seconds |")
        print("|---|---|---|---|---|")
        for r, rank_rows in enumerate(out):
            for name, extra, took in rank_rows:
                print(f"| {name} | {r} | {extra / 2**20:.0f} MiB | {extra / bf16_largest:.2f} | {took:.1f} |")
        print(f"checksums (bf16 stream vs float32 gather): {checks['streamed']:.4g} vs {checks['gathered']:.4g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if os.environ.get("RANK") is None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
        sys.exit(subprocess.call(cmd))
    rank_main()
