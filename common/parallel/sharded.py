"""What a step does with sharded models (DDP, FSDP2, DeepSpeed ZeRO, TP): one training backward, frozen
models, optimizer state that survives sharding, DeepSpeed's engine files, the guarded optimizer step
(`UpdateGuard`), and full weights for generation (`unwrap_for_generation`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from common.core.errors import UserError
from common.parallel.accelerator import is_deepspeed, tp_region


def backward(accelerator, model, loss: torch.Tensor, last: bool) -> None:
    """Backward of one micro-batch's share of a minibatch loss; `last` marks the minibatch's final
    micro-batch. DDP / FSDP2 / one process: `accelerator.backward`; gradients add up and the script
    steps the optimizer after the loop. DeepSpeed: the engine of `model` accumulates, and at `last`
    reduces, clips and steps (the script's opt.step / sched.step / zero_grad are then no-ops).
    The loss is not divided again (scale_wrt_gas=False): it already is a share of the minibatch mean."""
    if is_deepspeed(accelerator):
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss, scale_wrt_gas=False)
        if last:
            model.step()
    else:
        accelerator.backward(loss)


def prepare_frozen(accelerator, model: torch.nn.Module, under_autocast: bool = False) -> torch.nn.Module:
    """A model only run forward (reference policy, reward model): sharded like the trained models
    under FSDP2 and ZeRO-3, else moved to the device (never DDP-wrapped: it has no gradients).
    ZeRO-3: transformers loaded it partitioned already, so it needs an (optimizer-less) DeepSpeed
    engine to gather each layer in forward; call `configure_deepspeed` first.

    `under_autocast`: the caller runs every forward inside `accelerator.autocast()`. Under bf16 autocast,
    unsharded, the Linear layers' float32 weights are then stored in bf16 (`bf16_linear_weights`):
    autocast casts them to exactly these values in every forward, so the outputs are bit-identical,
    with ~40 % less memory for the model (SmolLM2: 0.21 GB) and no cast per forward."""
    model.eval().requires_grad_(False)
    sharded = (
        is_deepspeed(accelerator) or getattr(accelerator, "is_fsdp2", False) or getattr(accelerator, "tp_size", 1) > 1
    )
    if under_autocast and accelerator.mixed_precision == "bf16" and not sharded:
        bf16_linear_weights(model)
    if is_deepspeed(accelerator) and accelerator.state.deepspeed_plugin.zero_stage == 3:
        import copy

        import deepspeed

        cfg = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        cfg.pop("optimizer", None), cfg.pop("scheduler", None)
        engine = deepspeed.initialize(model=model, config=cfg)[0]
        engine.eval()
        return engine
    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        accelerator.state.fsdp_plugin.set_auto_wrap_policy(model)  # one FSDP unit per decoder layer
        return fsdp2_prepare_model(accelerator, model)
    return model.to(accelerator.device)


def frozen_reference(accelerator, model, tok) -> torch.nn.Module:
    """The frozen reference of a script's ModelArgs `model`: --model-name-or-path loaded again (no LoRA, no
    checkpointing), placed like the trained models and run inside accelerator.autocast() (`prepare_frozen`)."""
    from common.core import models as M

    ref = M.load_causal_lm(model.model_name_or_path, tok, **M.frozen_kwargs(model))
    return prepare_frozen(accelerator, ref, under_autocast=True)  # bf16 matmul weights stored as bf16


def bf16_linear_weights(model: torch.nn.Module) -> None:
    """Store float32 nn.Linear weights and biases of a frozen model in bfloat16, in place, except a weight
    shared with the input embedding (a tied LM head: the embedding output, and so the residual stream,
    stays float32 as autocast keeps it). Only for models run under bf16 autocast (see prepare_frozen)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = getattr(embedding, "weight", None)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight is not tied and m.weight.dtype == torch.float32:
            m.weight.data = m.weight.data.to(torch.bfloat16)
            if m.bias is not None:
                m.bias.data = m.bias.data.to(torch.bfloat16)


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
    call it, which is enough since only the main process writes checkpoints). Under DeepSpeed the
    state is saved by `save_engine_states` instead and this returns a marker."""
    if is_deepspeed(accelerator):
        return {"deepspeed": True}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    reshard(model)
    return get_optimizer_state_dict(
        model, getattr(opt, "optimizer", opt), options=_options(cpu_offload=accelerator.num_processes > 1)
    )


def load_optimizer_state(accelerator, model, opt, state: dict, folder: Path) -> None:
    """Inverse of optimizer_state: every process loads the full state and keeps its own shard.
    `folder` is the checkpoint's folder of this model (checkpoints/step_N/{name}); under DeepSpeed
    the engine reloads its per-rank files from {folder}/deepspeed."""
    if is_deepspeed(accelerator):
        if not state.get("deepspeed"):
            raise UserError(f"--resume {folder.parent}: written without DeepSpeed; resume it under DDP or FSDP2")
        check_deepspeed_files(folder / "deepspeed")  # DeepSpeed unpickles with weights_only=False: vet first
        model.load_checkpoint(
            str(folder / "deepspeed"),
            tag="state",
            load_module_strict=False,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        return
    if state.get("deepspeed"):
        raise UserError(f"--resume {folder.parent}: written under DeepSpeed; resume it under the same DeepSpeed config")
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    groups = state.get("param_groups") or [{}]
    if groups[0].get("params") and isinstance(groups[0]["params"][0], int):  # older checkpoints: plain opt.state_dict()
        opt.load_state_dict(state)
        return
    reshard(model)
    set_optimizer_state_dict(model, getattr(opt, "optimizer", opt), state, options=_options())


# The only non-tensor classes DeepSpeed's engine files hold (ZeRO-2 and ZeRO-3, fp32/bf16/fp16 here).
DEEPSPEED_GLOBALS = {
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
}


def check_deepspeed_files(folder: Path) -> None:
    """Refuse DeepSpeed engine files that would run code when unpickled.

    DeepSpeed's `load_checkpoint` calls `torch.load(..., weights_only=False)`, which executes whatever a
    pickle names: a planted payload would run. Before that, every file is read by torch's own scanner
    (`get_unsafe_globals_in_checkpoint`, which executes nothing) and any global outside plain tensors and
    the few DeepSpeed classes above stops the resume, naming the file."""
    for f in sorted(Path(folder).rglob("*.pt")):  # what DeepSpeed unpickles (its zero_to_fp32.py copies are never run)
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(f)))
        except Exception as e:  # not a torch checkpoint at all
            raise UserError(f"{f}: not a readable DeepSpeed checkpoint file ({e!r}); refusing to load it") from None
        if unsafe - DEEPSPEED_GLOBALS:
            raise UserError(
                f"{f}: refers to {sorted(unsafe - DEEPSPEED_GLOBALS)}, which loading would execute; "
                f"refusing to resume from it"
            )


def save_engine_states(accelerator, folder: Path, models: dict) -> None:
    """DeepSpeed only (no-op otherwise): each engine writes its optimizer and module shards, every
    rank its own files, into {folder}/{name}/deepspeed (a folder all processes see). Collective."""
    if not is_deepspeed(accelerator):
        return
    for name, m in models.items():
        m.save_checkpoint(
            str(Path(folder) / name / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True
        )


class UpdateGuard:
    """Clips gradients and takes the optimizer step only when their norm is finite.

    A non-finite loss or gradient (a NaN reward that slipped through, an overflow) would otherwise write
    NaN into the weights and every later checkpoint. Such a step is skipped (gradients zeroed) and
    counted (`train/skipped_steps`); `patience` skips in a row stop the run with a message naming the
    step and the model, the last checkpoint intact. Under DeepSpeed the engine steps inside backward
    and guards overflow itself (fp16 loss scaling); there the guard only clips and counts nothing."""

    def __init__(self, accelerator, patience: int = 5):
        self.accelerator, self.patience = accelerator, patience
        self.skipped, self.in_row = 0, 0

    def step(self, model, opt, max_grad_norm: float, what: str, step: int):
        """Clip, then step unless the norm is non-finite. Returns the gradient norm before clipping."""
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        if norm is not None and not torch.isfinite(torch.as_tensor(norm)).item():
            opt.zero_grad()
            self.skipped, self.in_row = self.skipped + 1, self.in_row + 1
            self.accelerator.print(f"[cleanrlhf] step {step}: {what} gradient norm is {float(norm)}; update skipped")
            if self.in_row >= self.patience:
                raise UserError(
                    f"step {step}: non-finite {what} gradient norm in {self.in_row} updates in a row; "
                    f"stopped before writing NaN weights (the last checkpoint is intact). Lower the "
                    f"learning rate, or check the rewards and the data"
                )
            return norm
        self.in_row = 0
        with tp_region(self.accelerator):
            opt.step()
        return norm

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "in_row": self.in_row}

    def load_state_dict(self, s: dict) -> None:
        self.skipped, self.in_row = s["skipped"], s["in_row"]


# ---------------------------------------------------------------------------------------------
# Full weights for generation (DDP, FSDP2, ZeRO-3)
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _zero3_hooks_off(engine):
    """ZeRO-3's per-module forward hooks removed while the parameters are gathered for a rollout: DeepSpeed keeps
    them on inside GatheredParameters, so every decoding step ran its fetch/release bookkeeping for every module
    (at 512 tokens of a 28-layer model, ~30k hook calls a row batch); TRL removes them the same way. Put back on
    exit, numbered as DeepSpeed numbered them (ds_id from 0: its trace is invalidated and re-recorded)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    offload = offload or getattr(engine, "optimizer", None)
    if offload is None or not hasattr(offload, "forward_hooks") or not hasattr(offload, "_register_deepspeed_module"):
        yield  # (not a ZeRO-3 engine this DeepSpeed version lays out so: its hooks stay)
        return
    for p in offload.module.parameters():
        getattr(p, "ds_active_sub_modules", set()).clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        offload._register_deepspeed_module(offload.module, count=[0])


@contextlib.contextmanager
def unwrap_for_generation(accelerator, model, engine=None):
    """The plain module to call `generate` on, with full weights while inside the block.

    With a vLLM `engine` (--rollout-engine vllm / vllm-server) nothing is gathered: the engine samples, and its
    push (`engine.begin_phase`, once for the block) streams the weights one parameter at a time from where they
    rest (common.parallel.weight_stream); on exit the engine may sleep (--vllm-sleep).

    DDP / single process: the unwrapped module. DeepSpeed ZeRO-3: parameters gathered once for the
    whole rollout phase and released on exit (what verl calls the hybrid engine), its per-module hooks off inside
    (`_zero3_hooks_off`). FSDP2
    (`fully_shard`): unshard once, keep unsharded across the many decode forwards, reshard on exit.
    Under bf16 autocast the block is one autocast region: the bf16 copies of the weights are cast once
    for the whole rollout (autocast caches them within a region), not in every decoding step's forward
    (each forward's own region would cast all weights again: SmolLM2, 0.54 GB read per token step)."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    if engine is not None:
        with torch.autocast(unwrapped.device.type if hasattr(unwrapped, "device") else "cpu", enabled=False):
            engine.begin_phase(unwrapped)
        try:
            yield unwrapped
        finally:
            engine.end_phase()
        return
    was_training = unwrapped.training
    unwrapped.eval()  # in train mode, gradient checkpointing would switch the KV cache off
    region = contextlib.ExitStack()
    if accelerator is not None:
        region.enter_context(accelerator.autocast())
    try:
        ds = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        if ds is not None and ds.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters())), _zero3_hooks_off(model):
                yield unwrapped
            return
        from torch.distributed.fsdp import FSDPModule

        if isinstance(unwrapped, FSDPModule):
            fsdp_modules = [m for m in unwrapped.modules() if isinstance(m, FSDPModule)]
            # torch has a setter but no getter for reshard_after_forward, and Accelerate sets it per
            # unit (True for layers, False for the root and the embedding/head unit): save the
            # per-unit settings (private attributes) and put them back exactly
            saved = [_reshard_setting(m) for m in fsdp_modules]
            for m in fsdp_modules:
                m.set_reshard_after_forward(False, recurse=False)
            # generate() may enter below the FSDP root (a peft model generates through its base model),
            # and FSDP infers its root from the first module that runs: initialise it from the root here
            unwrapped._get_fsdp_state()._lazy_init()
            unwrapped.unshard()
            try:
                yield unwrapped
            finally:
                for m, setting in zip(fsdp_modules, saved):
                    _restore_reshard_setting(m, setting)
                    m.reshard()
            return
        yield unwrapped
    finally:
        unwrapped.train(was_training)
        region.close()


def _param_groups(state) -> list:
    """An FSDP unit's parameter groups: a list in torch 2.12+, one group (or None) in earlier releases (torch 2.11's
    FSDPState has only `_fsdp_param_group`: a GPU image's torch failed here, benchmarks/gpu_check.sh)."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    return [g] if (g := state._fsdp_param_group) is not None else []


def _reshard_setting(m):
    state = m._get_fsdp_state()
    return state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in _param_groups(state)]


def _restore_reshard_setting(m, setting) -> None:
    state = m._get_fsdp_state()
    state._auto_reshard_after_forward = setting[0]
    for g, info in zip(_param_groups(state), setting[1]):
        g.post_forward_mesh_info = info
