"""Performance metrics every script logs: perf/mfu against this machine's measured matmul rate, perf/peak_mem_gb, and
the step's timings (step_perf)."""

import contextlib
import json
import math
import os
import platform
import time

import torch

from common.core.defaults import cache_dir
from common.integrations.engines import engine_perf

_PEAK: dict = {}


def matmul_peak_flops(device, dtype: torch.dtype = torch.float32) -> float:
    """This machine's measured matmul rate (FLOP/s) at transformer-layer shapes, the denominator of
    perf/mfu: a datasheet peak means little on a shared CPU. Measured once (~0.5 s) and kept in
    $CLEANRLHF_CACHE/matmul_peak.json by CPU model, threads, device and dtype."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    try:
        cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), name)
    except OSError:
        cpu = name
    key = f"{dev.type}|{name if dev.type == 'cuda' else cpu}|{torch.get_num_threads()}|{dtype}"
    if key in _PEAK:
        return _PEAK[key]
    path = cache_dir() / "matmul_peak.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        n = 4096 if dev.type == "cuda" else 1024
        a, b = torch.randn(n, 576, device=dev, dtype=dtype), torch.randn(576, 1536, device=dev, dtype=dtype)
        best = math.inf
        for _ in range(5):
            a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for _ in range(4):
                a @ b
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, (time.perf_counter() - t0) / 4)
        table[key] = 2 * n * 576 * 1536 / best
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
    _PEAK[key] = table[key]
    return _PEAK[key]


def mfu(model, forward_tokens: float, train_tokens: float, seconds: float, accelerator) -> float:
    """Model FLOPs utilisation of a step: (2 N per token run forward only, generation included, + 6 N
    per token trained) / seconds / the measured matmul peak of the compute dtype. N = the model's
    parameters but an untied input embedding; tokens are real tokens, so padding and recomputation show up as lost
    utilisation."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
    n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: the full size
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and emb.weight is not head.weight:  # an untied input embedding is a lookup, not FLOPs
        n -= getattr(emb.weight, "ds_numel", emb.weight.numel())
    dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else next(model.parameters()).dtype
    peak = matmul_peak_flops(accelerator.device, dtype)
    return (2 * n * forward_tokens + 6 * n * train_tokens) / max(seconds, 1e-9) / peak


def peak_mem_gb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    except Exception:
        return math.nan


def step_perf(accelerator, engine, step_s: float, gen_s: float, train_s: float, lengths=None, padding=None) -> dict:
    """A step's perf/* keys: step_s, gen_s (rollout), train_s (update) in seconds, peak_mem_gb, the engine's own
    (engines.engine_perf); with `lengths` (B,), the response lengths: tokens_per_s (all processes' response tokens per
    second of the step); with `padding` = (padded, real) tokens the forward passes ran: padding_frac."""
    out = {"perf/step_s": step_s, **engine_perf(engine), "perf/gen_s": gen_s, "perf/train_s": train_s}
    if lengths is not None:
        out["perf/tokens_per_s"] = accelerator.gather(lengths).sum().item() / step_s
    out["perf/peak_mem_gb"] = peak_mem_gb(accelerator.device)
    if padding is not None:
        out["perf/padding_frac"] = 1 - padding[1] / max(padding[0], 1)
    return out
