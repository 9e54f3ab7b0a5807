"""Accelerate glue every script shares: building the Accelerator, one training backward, frozen
models, and optimizer state that survives sharding.

Accelerate owns placement (DDP, FSDP2, DeepSpeed ZeRO); this module fills the gaps between it and
scripts that accumulate micro-batches into minibatches:

1. No GPU: `Accelerator(cpu=True)` gives CPU processes over gloo, but Accelerate ignores an FSDP
   launch config there and runs DDP. When the launch asked for FSDP2 (ACCELERATE_USE_FSDP=true,
   FSDP_VERSION=2, e.g. configs/accelerate/cpu_2proc_fsdp2.yaml) we switch Accelerate's own FSDP2
   path on for the CPU process group, so the code GPUs run (fully_shard per decoder layer) is the
   code the CPU tests run. DeepSpeed runs on CPU through its CPU accelerator when the process group
   is gloo (configs/accelerate/cpu_2proc_zero{2,3}.yaml).
2. DeepSpeed's engine, not the script, owns the optimizer step: it steps inside backward at an
   accumulation boundary and divides the loss by its accumulation count. `configure_deepspeed`
   tells it the scripts' micro-batch / minibatch sizes and clipping; `backward` marks the boundary
   and keeps the scripts' own loss scaling, so the same loop is exact under DDP, FSDP2 and ZeRO.
3. Under FSDP2, `accelerator.prepare` takes one model *with its optimizer* per call; a reference
   policy or reward model has no optimizer, so `prepare_frozen` shards it with Accelerate's FSDP2
   preparation directly (a 70B reference does not fit one GPU any more than the policy does).
4. Optimizer state: under DDP/FSDP2 gathered into a full state keyed by parameter name
   (torch.distributed.checkpoint.state_dict), so a checkpoint written by N processes resumes on M
   processes, under DDP or FSDP2, or on one process. Under DeepSpeed it stays in DeepSpeed's own
   per-rank files (engine.save_checkpoint), so resume needs the same number of processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from common.errors import UserError


def make_accelerator(model=None, tp_size: int = 1):
    """The Accelerator of every script: on GPUs whatever `accelerate launch` configured; without a
    GPU, CPU processes over gloo: DDP, or FSDP2 / DeepSpeed when the launch config asks (see above).
    `model` is a script's ModelArgs (common.args); its --mixed-precision ('no' / 'bf16') overrides the
    launch config's: bf16 autocast around the prepared models' forward (weights and optimizer stay float32),
    on CPU as on GPU. 'auto': bf16 where it pays for --model-name-or-path at weights --dtype
    (`auto_mixed_precision`), else as launched (`accelerate launch --mixed_precision`, default no).

    --tp-size > 1 (`model.tp_size`, else `tp_size`, or `parallelism_config_tp_size` of an accelerate config):
    tensor parallelism, see `TensorParallel` below; the processes form a (data-parallel x tensor-parallel)
    mesh and the loaders in common.models shard every model over the tensor-parallel dimension."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    mixed_precision = None
    if model is not None:
        mixed_precision, tp_size = model.mixed_precision, model.tp_size
        if mixed_precision == "auto":
            mixed_precision = auto_mixed_precision(model.model_name_or_path, model.dtype)
    tp_size = tp_size_from_launch(tp_size)
    # one scheduler step per sched.step() call: Accelerate's default steps it once per process (it assumes
    # each process's dataloader advanced), which would run warm-up and decay N times too fast on N processes
    kw = {"step_scheduler_with_optimizer": False}
    kw.update({"mixed_precision": mixed_precision} if mixed_precision else {})
    if tp_size > 1:
        return _tensor_parallel_accelerator(tp_size, **kw)
    if torch.cuda.is_available():
        return _fp32_reduction(Accelerator(**kw))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # say it, rather than DeepSpeed warning that it guessed
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        # cpu=True would skip DeepSpeed; naming the gloo backend lets DeepSpeed's CPU accelerator
        # start the process group and Accelerate count the processes
        return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kw)
    accelerator = Accelerator(cpu=True, **kw)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.num_processes > 1:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables `accelerate launch` set
        if plugin.fsdp_version != 2:
            raise UserError(
                "FSDP on CPU processes needs fsdp_version: 2 in the accelerate config "
                "(FSDP1 looks for a GPU: 'no available devices found')"
            )
        # both shared states, as Accelerate's own init does (a later AcceleratorState() copies PartialState's)
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    return _fp32_reduction(accelerator)


def _mp_policy(policy):
    """FSDP2's MixedPrecisionPolicy with gradients reduced in float32: Accelerate's `mixed_precision: bf16` sets
    reduce_dtype=bf16 (the reduce-scatter sums N ranks' bf16 gradients in bf16: 8 bits of mantissa lost per
    sum), while the weights and Adam states this project keeps are float32 (verl and torchtitan reduce in
    float32 too). Parameters are still gathered and computed in the policy's param_dtype; the cost is float32
    gradient traffic (2x bf16's). None (no mixed precision) -> reduce_dtype float32 as well."""
    import dataclasses

    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy is None:
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if not isinstance(policy, MixedPrecisionPolicy):  # FSDP1's MixedPrecision: left as the user configured it
        return policy
    return dataclasses.replace(policy, reduce_dtype=torch.float32)


def _fp32_reduction(accelerator):
    """Float32 gradient reduction under FSDP2 (`_mp_policy`), applied before any model is prepared."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "fsdp_version", 1) == 2:
        plugin.mixed_precision_policy = _mp_policy(plugin.mixed_precision_policy)
    return accelerator


def tp_size_from_launch(tp_size: int) -> int:
    """--tp-size, or an accelerate config's `parallelism_config_tp_size` when the flag is left at 1. Accelerate's
    own ParallelismConfig refuses CPU processes and covers TP only with FSDP2 on GPUs, so the scripts do TP
    themselves: the config's TP size is taken over (its other dimensions must be 1) and Accelerate is not
    asked to build it."""
    launched = int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1"))
    if tp_size < 1:
        raise UserError(f"--tp-size {tp_size}: must be >= 1")
    if launched > 1:
        others = {k: v for k, v in os.environ.items() if k.startswith("PARALLELISM_CONFIG_") and k.endswith("_SIZE")}
        others = {k: v for k, v in others.items() if k != "PARALLELISM_CONFIG_TP_SIZE" and int(v) > 1}
        if others:
            raise UserError(
                f"parallelism_config_tp_size {launched} with {others}: tensor parallelism combines with plain "
                "data parallelism here (the processes beyond one TP group); drop the other sizes"
            )
        if tp_size not in (1, launched):
            raise UserError(f"--tp-size {tp_size} and the accelerate config's parallelism_config_tp_size {launched}")
        tp_size = launched
        os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    return tp_size


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (--tp-size): PyTorch DTensor, transformers' tp_plan
# ---------------------------------------------------------------------------------------------
def tp_mesh_shape(world_size: int, tp_size: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of `world_size` processes. Ranks r*tp .. r*tp+tp-1 form
    TP group r (neighbouring ranks: on one node, where the per-layer all-reduces are cheapest), and rank
    k has data-parallel rank k // tp."""
    if world_size % tp_size:
        raise UserError(f"--tp-size {tp_size}: the {world_size} processes do not split into groups of {tp_size}")
    return world_size // tp_size, tp_size


class TensorParallel:
    """What the scripts' Accelerator becomes under --tp-size N (mixed into Accelerator, see below).

    The processes form a (dp, tp) mesh. Every model is loaded sharded over the tp dimension by
    transformers' tp_plan (common.models): Megatron-style column/row-parallel linears, a vocabulary-
    parallel embedding, and the LM head's logits gathered so every rank of a TP group holds the same
    (B, T, V) log-probs and losses. The ranks of one TP group run the same batch: so, to the scripts,
    `num_processes` and `process_index` are the data-parallel ones (batch flags are global over those),
    `gather` and `reduce` see one copy per TP group, `prepare` does not DDP-wrap (DTensor parameters), and
    `clip_grad_norm_` takes the norm over the shards. Only the global rank 0 writes (`is_main_process` is
    unchanged). With more processes than --tp-size (TP x DP), transformers also shards every model by
    FSDP2 over the data-parallel dimension (`fully_shard` over the "fsdp" mesh dimension): gradients are
    averaged over the data-parallel ranks in backward, as DDP would, and weights gathered per layer in
    forward (common.rollout.micro_batches gives every process as many micro-batches)."""

    tp_size: int
    tp_mesh: object  # the (dp, tp) DeviceMesh

    @property
    def num_processes(self) -> int:
        return self.state.num_processes // self.tp_size

    @property
    def process_index(self) -> int:
        return self.state.process_index // self.tp_size

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        # evaluation_mode: placed on the device, never DDP-wrapped (DDP refuses DTensor parameters)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)

    def gather(self, tensor):
        full = super().gather(tensor)  # every process's tensor in rank order: each TP group's copies side by side
        t = tensor if tensor.dim() else tensor[None]
        return full.view(self.num_processes, self.tp_size, *t.shape)[:, 0].reshape(-1, *t.shape[1:])

    def reduce(self, tensor, reduction="sum", scale=1.0):
        out = super().reduce(tensor, reduction, scale)  # over all processes; mean and max see copies alike
        return out / self.tp_size if reduction == "sum" else out

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2.0):
        """torch's clip_grad_norm_, per device mesh: under TP x FSDP2 the sharded linears live on the 2-D
        (fsdp, tp) mesh and the norms' weights on the 1-D fsdp mesh (plain tensors under TP alone), and
        torch refuses one norm over tensors of different meshes. Each group's norm is made whole, then
        combined, and every gradient scaled by the one total."""
        from torch.distributed.tensor import DTensor

        groups: dict = {}
        for p in parameters:
            if p.grad is not None:
                groups.setdefault(id(p.device_mesh) if isinstance(p, DTensor) else None, []).append(p)
        norms = []
        for params in groups.values():
            n = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def _tensor_parallel_accelerator(tp_size: int, **kw):
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from common import parallel

    class TensorParallelAccelerator(TensorParallel, Accelerator):
        pass

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        if os.environ.get(name, "false").lower() == "true":
            raise UserError(
                f"--tp-size {tp_size} under {name.split('_')[-1]}: with more processes than --tp-size, the "
                "models are already sharded by FSDP2 over the data-parallel ranks (TP x FSDP2, transformers' "
                "DistributedConfig); DeepSpeed AutoTP is not built. Launch without the FSDP / DeepSpeed config"
            )
    cpu = not torch.cuda.is_available()
    acc = TensorParallelAccelerator(cpu=cpu, **kw)
    acc.tp_size = tp_size
    dp, tp = tp_mesh_shape(acc.state.num_processes, tp_size)
    acc.tp_mesh = init_device_mesh(acc.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    # DTensor warns at every gradient-norm all-reduce and full-weight gather over the 2-D mesh that two
    # collectives run where one might (a latency note, not a correctness one): once per step per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    parallel.set_tensor_parallel(acc.tp_mesh["tp"], acc.tp_mesh["tp"].get_group(), acc.tp_mesh["dp"].get_group(), dp)
    return acc


def tp_region(accelerator):
    """Around an optimizer step or a weight load under --tp-size: plain tensors (the replicated norms) count
    as replicated DTensors beside the sharded ones (torch refuses mixing them in one fused kernel)."""
    if getattr(accelerator, "tp_size", 1) > 1:
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()
    return contextlib.nullcontext()


@contextlib.contextmanager
def saved_by_one_process(model):
    """Around `model.save_pretrained(folder, state_dict=...)` called by the main process alone with a state dict
    already gathered (`full_tensors`): transformers ends a TP model's save_pretrained with a barrier of every
    rank (it expects all of them to call it), which would pair with another collective; hide its TP config."""
    config = getattr(model, "config", None)
    saved = getattr(config, "distributed_config", None)
    if saved is not None:
        config.distributed_config = None
    try:
        yield
    finally:
        if saved is not None:
            config.distributed_config = saved


def full_tensors(state_dict: dict | None) -> dict | None:
    """A state dict with every DTensor gathered to its full tensor (collective: every process calls it, in
    the same order). What a checkpoint saves under --tp-size: ordinary model folders."""
    from torch.distributed.tensor import DTensor

    if state_dict is None:  # ZeRO-3 hands the gathered state dict to rank 0 only
        return None
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state_dict.items()}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls at ~2x the float32 rate (2.35x measured here); elsewhere
    torch emulates them, slower than float32."""
    try:
        flags = next(x for x in open("/proc/cpuinfo") if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_mixed_precision(model: str | None, dtype: str = "auto") -> str | None:
    """--mixed-precision auto: 'bf16' where it was measured to pay (docs/performance.md), else None (as
    launched). It pays on a CPU with native bf16 matmul, float32 weights, and a model of hidden size
    >= 256 (SmolLM2-135M: the step at 0.67x the float32 time; the hidden-64 test models train 2.3x
    slower in bf16: the casts cost more than the small matmuls save). On a GPU with bf16 it is bf16 for
    float32 weights (the default: float32 master weights, bf16 compute, as verl, DeepSpeed and FSDP mixed
    precision train), unless the launch config chose fp16 or bf16 itself; `accelerate launch`'s own default
    'no' is not read as a choice there (--mixed-precision no asks for float32 compute)."""
    if dtype not in ("auto", "float32"):
        return None
    if torch.cuda.is_available():
        launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        return "bf16" if torch.cuda.is_bf16_supported() and launched in ("no", "") else None
    if model is None:
        return None
    if os.environ.get("ACCELERATE_MIXED_PRECISION") or not cpu_has_native_bf16():
        return None
    try:
        from transformers import AutoConfig

        from common.models import resolve_model_path

        config = AutoConfig.from_pretrained(resolve_model_path(model))
    except Exception:  # a bad path is reported where the model loads, with the flag named
        return None
    hidden = getattr(getattr(config, "text_config", None) or config, "hidden_size", 0) or 0
    return "bf16" if hidden >= 256 else None


def is_deepspeed(accelerator) -> bool:
    return str(accelerator.distributed_type).endswith("DEEPSPEED")


def configure_deepspeed(accelerator, micro_batch_size: int, accumulation_steps: int, max_grad_norm: float) -> None:
    """Before `accelerator.prepare`: give DeepSpeed the per-process micro-batch size, the number of
    micro-batches per optimizer step and the clipping norm (it clips inside its step; the scripts'
    `accelerator.clip_grad_norm_` is a no-op there). Does nothing unless DeepSpeed is on."""
    if not is_deepspeed(accelerator):
        return
    cfg = accelerator.state.deepspeed_plugin.deepspeed_config
    cfg["train_micro_batch_size_per_gpu"] = micro_batch_size
    cfg["gradient_accumulation_steps"] = accumulation_steps
    cfg["train_batch_size"] = micro_batch_size * accumulation_steps * accelerator.num_processes
    cfg["gradient_clipping"] = max_grad_norm
    cfg.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = (
        True  # full save_pretrained folders
    )


def micro_batch_budget(accelerator, micro_batch_tokens: int) -> int:
    """--micro-batch-tokens as this launch can run it: DeepSpeed's engine counts micro-batches per
    optimizer step, so there the default (-1, packed) becomes 0 (row micro-batches) and an explicit
    budget is a user error."""
    if not is_deepspeed(accelerator) or micro_batch_tokens == 0:
        return micro_batch_tokens
    if micro_batch_tokens > 0:
        raise UserError("--micro-batch-tokens: DeepSpeed needs a fixed number of micro-batches per step; use 0")
    return 0


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
    from common import models as M

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
    rest (common.weight_stream); on exit the engine may sleep (--vllm-sleep).

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
