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

import torch

from common.core.errors import UserError


def make_accelerator(model=None, tp_size: int = 1):
    """The Accelerator of every script: on GPUs whatever `accelerate launch` configured; without a
    GPU, CPU processes over gloo: DDP, or FSDP2 / DeepSpeed when the launch config asks (see above).
    `model` is a script's ModelArgs (common.harness.args); its --mixed-precision ('no' / 'bf16') overrides the
    launch config's: bf16 autocast around the prepared models' forward (weights and optimizer stay float32),
    on CPU as on GPU. 'auto': bf16 where it pays for --model-name-or-path at weights --dtype
    (`auto_mixed_precision`), else as launched (`accelerate launch --mixed_precision`, default no).

    --tp-size > 1 (`model.tp_size`, else `tp_size`, or `parallelism_config_tp_size` of an accelerate config):
    tensor parallelism, see `TensorParallel` below; the processes form a (data-parallel x tensor-parallel)
    mesh and the loaders in common.core.models shard every model over the tensor-parallel dimension."""
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
    transformers' tp_plan (common.core.models): Megatron-style column/row-parallel linears, a vocabulary-
    parallel embedding, and the LM head's logits gathered so every rank of a TP group holds the same
    (B, T, V) log-probs and losses. The ranks of one TP group run the same batch: so, to the scripts,
    `num_processes` and `process_index` are the data-parallel ones (batch flags are global over those),
    `gather` and `reduce` see one copy per TP group, `prepare` does not DDP-wrap (DTensor parameters), and
    `clip_grad_norm_` takes the norm over the shards. Only the global rank 0 writes (`is_main_process` is
    unchanged). With more processes than --tp-size (TP x DP), transformers also shards every model by
    FSDP2 over the data-parallel dimension (`fully_shard` over the "fsdp" mesh dimension): gradients are
    averaged over the data-parallel ranks in backward, as DDP would, and weights gathered per layer in
    forward (common.core.forwards.micro_batches gives every process as many micro-batches)."""

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

    from common.core import process_groups as parallel

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

        from common.core.hub import resolve_model_path

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
