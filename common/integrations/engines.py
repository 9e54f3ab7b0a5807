"""`--rollout-engine`: which engine a script or tool samples with. hf: None (common.core.forwards's decoding loop);
vllm: a colocated engine (common.integrations.vllm_engine); vllm-server: vLLM's own server
(common.integrations.vllm_server). docs/rollout.md."""

from __future__ import annotations

import torch

from common.core.errors import UserError
from common.integrations.http import free_port
from common.integrations.vllm_engine import VLLMEngine
from common.integrations.vllm_server import ServerEngine, ServerProcess, make_server_engine


def engine_perf(engine) -> dict:
    """perf/vllm_wakes: times the colocated engine woke from --vllm-sleep since the last log (one per rollout phase:
    1 a step, 2 with an evaluation); nothing for the other engines."""
    return {"perf/vllm_wakes": engine.take_wakes()} if isinstance(engine, VLLMEngine) and engine.sleep else {}


def make_engine(gen, model, tok, policy, accelerator=None, max_model_len: int | None = None, seed: int = 0):
    """The scripts' --rollout-engine, from GenerationArgs `gen` and ModelArgs `model` (common.harness.args): None for hf
    (our decoding loop), else a VLLMEngine for --model-name-or-path's architecture (its weights are replaced at the
    first rollout by the policy's own), in the trainer's compute dtype, holding sequences of `max_model_len`
    tokens, sampling from `seed` + the process index."""
    if gen.rollout_engine == "hf":
        return None
    if getattr(accelerator, "tp_size", 1) > 1 and gen.rollout_engine == "vllm":
        raise UserError(
            f"--rollout-engine vllm with --tp-size {accelerator.tp_size}: every TP rank would hold a whole "
            "engine (the memory TP saves); generate with the hf engine from the sharded policy, or on a server "
            "(--rollout-engine vllm-server)"
        )
    from common.core.hub import resolve_model_path

    path = str(resolve_model_path(model.model_name_or_path))
    unwrapped = accelerator.unwrap_model(policy) if accelerator is not None else policy
    # the trainer's compute dtype: bf16 under --mixed-precision bf16 (the weights are cast as they are pushed;
    # on this CPU 270 vs 162 tokens/s in float32: docs/rollout.md), else the weights' own
    bf16 = accelerator is not None and str(accelerator.mixed_precision) == "bf16"
    dtype = torch.bfloat16 if bf16 else next(unwrapped.parameters()).dtype
    process = accelerator.process_index if accelerator is not None else 0
    lora_rank = model.lora_r if gen.vllm_lora_sync == "adapter" else 0
    if gen.rollout_engine == "vllm-server":  # one server for every process: the run's seed
        return make_server_engine(gen, path, tok, dtype, max_model_len, seed, accelerator, lora_rank)
    return VLLMEngine(
        path,
        tok,
        lora_rank=lora_rank,
        max_model_len=max_model_len,
        seed=seed + process,
        dtype=dtype,
        gpu_memory_utilization=gen.vllm_gpu_memory_utilization,
        kv_cache_gb=gen.vllm_kv_cache_gb,
        tensor_parallel_size=gen.vllm_tensor_parallel_size,
        sleep=gen.vllm_sleep,
        trust_remote_code=model.trust_remote_code,
        enforce_eager=gen.enforce_eager(),
    )


def frozen_engine(gen, model, path: str, tok, max_model_len: int, seed: int) -> VLLMEngine:
    """A colocated vLLM engine of `path`'s own weights, never synced (distill_llm.py's --teacher-engine vllm), with
    GenerationArgs `gen`'s memory settings and ModelArgs `model`'s --trust-remote-code, in the default dtype."""
    from common.core import models as M
    from common.core.hub import resolve_model_path

    return VLLMEngine(
        str(resolve_model_path(path)), tok, max_model_len, seed, dtype=M.default_dtype(), enforce_eager=gen.enforce_eager(),
        gpu_memory_utilization=gen.vllm_gpu_memory_utilization, kv_cache_gb=gen.vllm_kv_cache_gb,
        trust_remote_code=model.trust_remote_code,
    )  # fmt: skip


def tool_engine(
    rollout_engine: str,
    name: str,
    tok,
    model,
    engine=None,
    gpu_memory_utilization: float = 0.5,
    kv_cache_gb=1.0,
    server_url: str = "",
):
    """The tools' --rollout-engine (evaluate, gen_preferences, gen_demos): None for hf; else `engine` (or a new one
    made from `name`'s folder: colocated, or vllm-server attached to `server_url` or started here) holding `model`'s
    weights. One engine serves several models of one architecture: their weights are pushed in turn."""
    if rollout_engine == "hf":
        return None
    if engine is None:
        from common.core.hub import resolve_model_path

        path, dtype = str(resolve_model_path(name)), next(model.parameters()).dtype
        if rollout_engine == "vllm-server":
            if server_url:
                engine = ServerEngine(server_url, tok, dtype=dtype)
            else:
                port = free_port()
                start = lambda: ServerProcess(path, port, dtype, None, 0, kv_cache_gb=kv_cache_gb)  # noqa: E731
                engine = ServerEngine(f"http://127.0.0.1:{port}", tok, dtype=dtype, start=start)
        else:
            engine = VLLMEngine(
                path,
                tok,
                max_model_len=None,
                seed=0,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_gb=kv_cache_gb,
            )
    engine.sync(model, force=True)
    return engine
