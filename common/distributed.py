"""Accelerate glue every script shares: building the Accelerator, sharding frozen models, and
optimizer state that survives sharding.

Accelerate owns placement (DDP, FSDP2, DeepSpeed); this module only fills three gaps:

1. No GPU: `Accelerator(cpu=True)` gives CPU processes over gloo, but Accelerate ignores an FSDP
   launch config there and runs DDP. When the launch asked for FSDP2 (ACCELERATE_USE_FSDP=true,
   FSDP_VERSION=2, e.g. configs/accelerate/cpu_2proc_fsdp2.yaml) we switch Accelerate's own FSDP2
   path on for the CPU process group, so the code GPUs run (fully_shard per decoder layer) is the
   code the CPU tests run.
2. Under FSDP2, `accelerator.prepare` takes one model *with its optimizer* per call; a reference
   policy or reward model has no optimizer, so `prepare_frozen` shards it with Accelerate's FSDP2
   preparation directly (a 70B reference does not fit one GPU any more than the policy does).
3. An FSDP2 optimizer holds DTensor shards; `optimizer_state` gathers them into a full state keyed
   by parameter name (torch.distributed.checkpoint.state_dict), so a checkpoint written by N
   processes resumes on M processes, under DDP or FSDP2, or on one process.
"""

from __future__ import annotations

import os

import torch


def make_accelerator():
    """The Accelerator of every script: on GPUs whatever `accelerate launch` configured; without a
    GPU, CPU processes over gloo, with FSDP2 when the launch config asks for it (see above)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        # DeepSpeed's engine steps inside backward at its own accumulation boundary and keeps its
        # optimizer state in its own sharded format; these scripts step once per minibatch after a
        # micro-batch loop and checkpoint a full state. Running them under ZeRO as they are would
        # step on every micro-batch, silently; so refuse (see docs/distributed.md).
        raise SystemExit("DeepSpeed (distributed_type: DEEPSPEED in the accelerate config) is not supported by the "
                         "cleanrlhf scripts yet; use configs/accelerate/fsdp2.yaml: FSDP2 shards parameters, gradients "
                         "and optimizer states as ZeRO-3 does, and it is tested (docs/distributed.md)")
    if torch.cuda.is_available():
        return Accelerator()
    accelerator = Accelerator(cpu=True)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.num_processes > 1:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` set
        if plugin.fsdp_version != 2:
            raise SystemExit("FSDP on CPU processes needs fsdp_version: 2 in the accelerate config "
                             "(FSDP1 looks for a GPU: 'no available devices found')")
        # both shared states, as Accelerate's own init does (a later AcceleratorState() copies PartialState's)
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return accelerator


def prepare_frozen(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A model only run forward (reference policy, reward model): FSDP2-sharded like the trained
    models when FSDP2 is on, else moved to the device (never DDP-wrapped: it has no gradients)."""
    model.eval().requires_grad_(False)
    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        accelerator.state.fsdp_plugin.set_auto_wrap_policy(model)  # one FSDP unit per decoder layer
        return fsdp2_prepare_model(accelerator, model)
    return model.to(accelerator.device)


def reshard(model) -> None:
    """Put every FSDP2 unit of `model` back to its shards (no-op otherwise). Units that Accelerate
    sets not to reshard after forward (the root, the embedding/head unit) stay unsharded after a
    no_grad forward (evaluation, scoring), since no backward follows to reshard them; their
    parameters are then plain tensors that the optimizer does not know, and saving fails."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def optimizer_state(accelerator, model, opt) -> dict:
    """The optimizer's full state, keyed by parameter name, on CPU. Collective: every process calls
    it; with several processes only the main one gets the tensors (the others get what they need to
    call it, which is enough since only the main process writes checkpoints)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    reshard(model)
    return get_optimizer_state_dict(model, getattr(opt, "optimizer", opt),
                                    options=_options(cpu_offload=accelerator.num_processes > 1))


def load_optimizer_state(accelerator, model, opt, state: dict) -> None:
    """Inverse of optimizer_state: every process loads the full state and keeps its own shard."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    reshard(model)
    set_optimizer_state_dict(model, getattr(opt, "optimizer", opt), state, options=_options())
