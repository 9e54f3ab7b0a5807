"""Checkpoints: `checkpoints/step_N/` holds every trained model as a complete `save_pretrained` folder plus
`trainer_state.pt` (optimizers, schedulers, RNG states, step, the script's own state); written to a temp
name, fsynced and renamed, so a crash never leaves a half checkpoint; loaded with weights_only=True only."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from common.core.errors import UserError
from common.core.hub import SHARD_FILES, SHARDED_MARK, shard_damage, shard_files
from common.harness.flags import flat_args


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        # numpy's state holds an ndarray; a tensor keeps torch.load(weights_only=True) possible
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(s: dict) -> None:
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    n = s["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), *n[2:]))
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(
    accelerator,
    run_dir: Path,
    step: int,
    models: dict,
    state: dict,
    keep_last: int = 0,
    tokenizer=None,
    args=None,
    save_merged: bool = False,
    label: str | None = None,
    optimizers: dict | None = None,
    sharded: bool = False,
) -> Path:
    """checkpoints/step_{step}/{name}/ (save_pretrained) for each model + trainer_state.pt.

    trainer_state.pt holds `state` (an object's `state_dict()`, or a plain value) and each optimizer
    of `optimizers` = {key: (model name, optimizer)} under its key; `restore_checkpoint` is the mirror
    and takes the same three dicts, so a script writes its state keys once.

    Each model folder is a model: weights, config, generation config and `tokenizer`'s files (chat
    template included), so `AutoModel*.from_pretrained`, `AutoTokenizer.from_pretrained` and our own
    `--model-name-or-path` load it as it is. A LoRA model saves its adapter (plus the tokenizer; our
    loaders merge it onto its base), and with `save_merged` also `{name}_merged/`, the full merged
    model, for tools without peft (vLLM, TGI). trainer_state.pt records the algorithm and the args.
    `label` names the folder instead of `step_{step}` (e.g. "best": --save-best).

    `sharded` (--checkpoint-format sharded): no gather. The models' and optimizers' states go to step_N/sharded/
    through torch.distributed.checkpoint, every process writing its own shards (`sharded_state`); each model folder
    holds its config and tokenizer only, and becomes a full model folder when first loaded (common.core.models).

    Written into a temp folder and renamed at the end, so a crash mid-save leaves the previous
    checkpoints untouched and no half checkpoint under a step_ name. `keep_last` > 0 deletes older ones."""
    from accelerate.utils import broadcast_object_list

    from common.parallel.accelerator import full_tensors, saved_by_one_process
    from common.parallel.sharded import optimizer_state, reshard, save_engine_states

    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items()}
    for key, (name, opt) in (optimizers or {}).items() if not sharded else ():
        state[key] = optimizer_state(accelerator, models[name], opt)  # collective under FSDP2

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / (label or f"step_{step}")
    for m in models.values():
        reshard(m)  # FSDP2: units left unsharded by a no_grad forward back to DTensor shards
    shards = sharded_state(models, optimizers or {}) if sharded else None  # this process's shards, no gather
    state_dicts = {
        name: _drop_tied_copies(
            accelerator.unwrap_model(m), full_tensors(accelerator.get_state_dict(m))
        )  # collective under FSDP/ZeRO-3 and --tp-size
        if not sharded else shards[name]
        for name, m in models.items()
    }  # fmt: skip
    for name, sd in state_dicts.items():  # never a checkpoint of non-finite weights (ZeRO-3: rank 0 holds them)
        bad = _non_finite(sd or {})
        if sharded:  # each process sees its own shards: all of them refuse together
            n_bad = accelerator.reduce(torch.tensor([len(bad)], device=accelerator.device), "sum").item()
            bad = bad or (["(a shard of another process)"] if n_bad else [])
        if bad:
            intact = max(list_checkpoints(run_dir), key=step_of, default=None)
            raise RuntimeError(
                f"step {step}: {name} has non-finite weights ({len(bad)} tensors, e.g. {bad[0]}), so checkpoint "
                f"{final.name} is not written; {intact.name + ' is intact' if intact else 'no earlier checkpoint exists'}"
            )
    tmp = [None]
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = [tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=ckpt_root)]
    if accelerator.state.num_processes > 1:
        broadcast_object_list(tmp, from_process=0)  # DeepSpeed: every rank writes its shards there
    tmp = Path(tmp[0])
    save_engine_states(accelerator, tmp, models)
    if sharded:
        import torch.distributed.checkpoint as dcp

        try:
            with warnings.catch_warnings():  # one process, no process group: "assuming ... a single process", yes
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(shards, checkpoint_id=str(tmp / "sharded"))  # collective: each process writes its files
        except BaseException as e:  # the half-written folder goes; the previous checkpoints are untouched
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise _full_disk(e, run_dir, final) or e
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        try:
            if sharded:  # every file's size and CRC-32 (all processes' files are written: waited above)
                (tmp / "sharded" / SHARD_FILES).write_text(json.dumps(shard_files(tmp / "sharded")) + "\n")
            for name, m in models.items():
                unwrapped = accelerator.unwrap_model(m)
                if sharded:  # the model's config and tokenizer: common.core.models makes the folder whole on first load
                    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
                    # the class that loads it, as save_pretrained writes it (a critic's or RM's head, not an LM's): the
                    # transformers class, not FSDP2's FSDP<class> subclass
                    cls = next(c for c in type(base).__mro__ if c.__module__.startswith("transformers."))
                    unwrapped.config.architectures = [cls.__name__]
                    unwrapped.config.save_pretrained(tmp / name)
                    if getattr(unwrapped, "generation_config", None) is not None:
                        unwrapped.generation_config.save_pretrained(tmp / name)
                    (tmp / name / SHARDED_MARK).write_text(json.dumps({"model": name, "step": step}) + "\n")
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp / name)
                    continue
                with saved_by_one_process(unwrapped):
                    unwrapped.save_pretrained(tmp / name, state_dict=state_dicts[name], safe_serialization=True)
                folders = [tmp / name]
                if save_merged and hasattr(unwrapped, "peft_config"):
                    from common.core.models import merge_lora_state_dict

                    cfg = unwrapped.peft_config["default"]
                    merged = merge_lora_state_dict(state_dicts[name], cfg.lora_alpha / cfg.r)
                    unwrapped.get_base_model().save_pretrained(
                        tmp / f"{name}_merged", state_dict=merged, safe_serialization=True
                    )
                    folders.append(tmp / f"{name}_merged")
                for folder in folders if tokenizer is not None else []:
                    tokenizer.save_pretrained(folder)
            meta = {"algo": run_dir.name.split("__")[0], "args": flat_args(args) if args is not None else {}}
            meta["format"] = "sharded" if sharded else "full"
            meta["run_id"] = run_id_of(run_dir)  # which run wrote it: a step folder from another run is refused
            torch.save({**state, **meta, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
            # the same, readable without unpickling the (large) state: what --resume checks first
            (tmp / "checkpoint.json").write_text(json.dumps({**meta, "step": step}, indent=1, default=str))
            _fsync_tree(tmp)  # on disk before the rename makes it the checkpoint
        except BaseException as e:  # whatever stopped the write, the half-written folder goes
            shutil.rmtree(tmp, ignore_errors=True)
            # torch.save on a full disk raises RuntimeError ("unexpected pos ..."), safetensors its SafetensorError
            # ("No space left on device (os error 28)"), neither an OSError(ENOSPC): found on a real full tmpfs
            raise _full_disk(e, run_dir, final) or e
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the folder gets the user's usual permissions
        old = None
        if final.exists():  # re-saving the same name (a resume, checkpoints/best): swap, then delete the old one
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if keep_last > 0:
            for old in sorted(list_checkpoints(run_dir), key=step_of)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


class BestKeeper:
    """--save-best METRIC: is this evaluation the best so far? Higher is better, except for losses
    (`loss/...`, `eval/loss`). Its state goes into checkpoints so a resumed run compares alike."""

    def __init__(self, metric: str | None):
        self.metric, self.best = metric, None

    def improved(self, metrics: dict) -> bool:
        if not self.metric or self.metric not in metrics:
            return False
        value, lower = metrics[self.metric], "loss" in self.metric
        if self.best is None or (value < self.best if lower else value > self.best):
            self.best = value
            return True
        return False

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, s: dict) -> None:
        self.best = s["best"]


def _full_disk(e: BaseException, run_dir: Path, final: Path) -> UserError | None:
    """The one line for a save that stopped on a full disk (else None). torch.save raises RuntimeError ("unexpected
    pos ..."), safetensors its SafetensorError ("No space left on device (os error 28)"), torch.distributed.checkpoint
    a CheckpointException (a BaseException) around either; none an OSError(ENOSPC): found on a real full tmpfs."""
    said, ckpt_root = str(e), run_dir / "checkpoints"
    full = (
        getattr(e, "errno", None) == errno.ENOSPC
        or "No space left on device" in said
        or "unexpected pos" in said
        or (isinstance(e, RuntimeError) and _nearly_full(ckpt_root))
    )
    if not full:
        return None
    intact = max(list_checkpoints(run_dir), key=step_of, default=None)
    err = UserError(f"no space left on {ckpt_root} while writing checkpoint {final.name}; "
                    f"{intact.name + ' is intact' if intact else 'no earlier checkpoint exists'}")  # fmt: skip
    err.__cause__ = e
    return err


def _nearly_full(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_temp_checkpoints(run_dir: Path) -> list[str]:
    """`.step_N.tmp-*` / `.best.tmp-*` folders left by a crash mid-save (never a checkpoint): removed."""
    root = Path(run_dir) / "checkpoints"
    stale = [p for p in root.glob(".*.tmp-*")] + [p for p in root.glob(".*.old-*")] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return [p.name for p in stale]


def _drop_tied_copies(model, state_dict: dict) -> dict:
    """Keep one name per tied parameter (e.g. lm_head.weight = embed_tokens.weight). save_pretrained
    spots ties by shared storage, but under FSDP2 / ZeRO-3 the gathered state dict holds separate
    copies, so the folder would carry the tensor twice."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    aliases = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {k: v for k, v in state_dict.items() if k not in aliases} if state_dict is not None else state_dict


def step_of(p: Path) -> int:
    """The step of a checkpoint folder: from its name (step_N), else (checkpoints/best) from its trainer state."""
    if p.name.startswith("step_") and p.name[5:].isdigit():
        return int(p.name[5:])
    return int(torch.load(p / "trainer_state.pt", weights_only=True)["step"])


def run_id_of(run_dir: Path) -> str:
    """A run's identity: the name its folder was created with (args.json's run_id; a renamed folder keeps it)."""
    try:
        return json.loads((Path(run_dir) / "args.json").read_text()).get("run_id") or Path(run_dir).name
    except (OSError, ValueError, AttributeError):
        return Path(run_dir).name


def checkpoint_record(ckpt: Path) -> dict:
    """What a checkpoint says of itself (algo, run_id, step, the flags as run): checkpoint.json, or for
    checkpoints written before it existed the same keys of trainer_state.pt; {} if neither can be read."""
    try:
        return json.loads((Path(ckpt) / "checkpoint.json").read_text())
    except (OSError, ValueError):
        pass
    try:
        saved = load_trainer_state(Path(ckpt))
        return {k: saved[k] for k in ("algo", "args", "run_id", "step") if k in saved}
    except Exception:
        return {}


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [
        p
        for p in root.iterdir()
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / "trainer_state.pt").exists()
    ]


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder, or a run folder (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "trainer_state.pt").exists():
        return p
    ckpts = list_checkpoints(p)
    if not ckpts:
        raise FileNotFoundError(f"--resume {path}: no complete checkpoint (checkpoints/step_N/trainer_state.pt) found")
    return max(ckpts, key=step_of)


def _non_finite(state_dict: dict) -> list[str]:
    """Names of floating tensors with a NaN or inf (a DTensor: this process's shard). A QLoRA base weight (its
    bitsandbytes quant state beside it) holds packed 4-bit codes in a float dtype (bnb_4bit_quant_storage): bytes,
    not numbers, so it is not checked."""
    from torch.distributed.tensor import DTensor

    local = lambda v: v.to_local() if isinstance(v, DTensor) else v  # noqa: E731
    packed = {k.split(".quant_state.")[0] for k in state_dict if ".quant_state." in k}
    return [k for k, v in state_dict.items() if k not in packed
            and torch.is_tensor(v) and v.is_floating_point() and not local(v).isfinite().all()]  # fmt: skip


def sharded_state(models: dict, optimizers: dict) -> dict:
    """{model name: its state dict, optimizer key: its state dict}, as each process holds them (FSDP2 / TP:
    DTensor shards; DDP or one process: whole tensors, which torch.distributed.checkpoint writes once). An
    optimizer that has not stepped yet gets its state made (a zero step), so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from common.parallel.sharded import reshard

    out = {}
    for name, m in models.items():
        reshard(m)
        out[name] = get_model_state_dict(m)
    for key, (name, opt) in optimizers.items():
        out[key] = get_optimizer_state_dict(models[name], getattr(opt, "optimizer", opt))
    return out


def _shard_damage_once(folder: Path) -> str | None:
    """shard_damage (it reads every file: a CRC-32 each), computed by rank 0 alone and told to the others."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [shard_damage(folder) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(out, src=0)
        return out[0]
    return shard_damage(folder)


def load_sharded(folder: Path, models: dict, optimizers: dict) -> None:
    """The mirror of a sharded save, after accelerator.prepare: torch.distributed.checkpoint reads each process's
    part of every tensor, whatever the number of processes that wrote them (resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if (problem := _shard_damage_once(folder)) is not None:  # a cut, missing or altered file: named before any read
        raise UserError(f"{problem}{earlier_intact(folder.parent)}")
    shards = sharded_state(models, optimizers)
    try:
        with warnings.catch_warnings():  # one process, no process group: "assuming ... a single process", yes
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(shards, checkpoint_id=str(folder))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException; another model's tensors
        first = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise UserError(
            f"{folder}: could not be loaded ({type(e).__name__}: {first[:200]}){earlier_intact(folder.parent)}"
        ) from e
    for name, m in models.items():
        set_model_state_dict(m, shards[name])
    for key, (name, opt) in optimizers.items():
        set_optimizer_state_dict(models[name], getattr(opt, "optimizer", opt), shards[key])


def is_sharded(ckpt: Path | None) -> bool:
    return ckpt is not None and (Path(ckpt) / "sharded").is_dir()


def load_trainer_state(ckpt: Path) -> dict:
    """trainer_state.pt, unpickled with weights_only=True: tensors and plain containers only, so a
    planted payload is refused instead of run."""
    import pickle

    try:
        return torch.load(ckpt / "trainer_state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{ckpt / 'trainer_state.pt'}: holds objects other than tensors and plain values "
            f"({str(e).splitlines()[0][:160]}); refusing to load it"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:  # a truncated zip: "PytorchStreamReader failed ...", EINVAL
        raise UserError(f"{ckpt / 'trainer_state.pt'}: damaged ({type(e).__name__}: {str(e)[:160]})"
                        f"{earlier_intact(ckpt)}") from None  # fmt: skip


def damage(ckpt: Path) -> str | None:
    """What is visibly damaged in a checkpoint folder, cheaply (no weights read): trainer_state.pt that is not a
    whole zip archive (torch.save's format: its directory sits at the end, so a cut file fails), a .safetensors
    file whose header does not cover the file. None when it looks whole."""
    import zipfile

    from safetensors import safe_open

    try:
        zipfile.ZipFile(Path(ckpt) / "trainer_state.pt").close()
    except (zipfile.BadZipFile, OSError) as e:
        return f"{Path(ckpt) / 'trainer_state.pt'}: damaged ({e})"
    if is_sharded(ckpt) and (problem := shard_damage(Path(ckpt) / "sharded")) is not None:
        return problem
    for f in sorted(Path(ckpt).glob("*/*.safetensors")):
        try:
            with safe_open(str(f), "pt"):
                pass
        except Exception as e:
            return f"{f}: damaged ({e})"
    return None


def earlier_intact(ckpt: Path) -> str:
    """'; <the newest earlier checkpoint of the run that looks whole> is intact: --resume it' (or '')."""
    ckpt = Path(ckpt)
    earlier = sorted((c for c in list_checkpoints(ckpt.parent.parent) if step_of(c) < step_of(ckpt)), key=step_of)
    intact = next((c for c in reversed(earlier) if damage(c) is None), None)
    return f"; {intact.name} is intact: --resume {intact} (or --resume auto)" if intact else ""


# Keys added to trainer_state.pt after the first checkpoints were written: an older checkpoint
# without them resumes with the object's fresh state (which is what it had then).
STATE_ADDED_LATER = {"best", "guard"}


def restore_checkpoint(accelerator, ckpt: Path, models: dict, state: dict, optimizers: dict) -> int:
    """The mirror of save_checkpoint, called after accelerator.prepare with the same dicts: each
    optimizer's state, each object's load_state_dict under its key, the RNG streams. Returns the
    step to continue after. (The weights are loaded before prepare, with load_weights.)"""
    from common.parallel.sharded import load_optimizer_state

    saved = load_trainer_state(ckpt)
    if is_sharded(ckpt):  # the models' weights and the optimizers, resharded to this run's processes
        load_sharded(ckpt / "sharded", models, optimizers)
    for key, (name, opt) in optimizers.items() if not is_sharded(ckpt) else ():
        load_optimizer_state(accelerator, models[name], opt, saved[key], ckpt / name)
    for key, obj in state.items():
        if key not in saved and key in STATE_ADDED_LATER:
            continue
        if key not in saved:
            raise UserError(
                f"{ckpt / 'trainer_state.pt'}: no {key!r} state (written by another version of this script?)"
            )
        obj.load_state_dict(saved[key])
    set_rng_state(saved["rng"])
    return saved["step"]


def load_weights(model, folder: Path) -> None:
    """Load a save_pretrained folder's weights into an already-built (possibly peft) model in place."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    sd = {}
    for f in files:
        try:
            sd.update(load_file(f))
        except Exception as e:  # a truncated or overwritten file: name it (safetensors' own text is cryptic)
            raise UserError(
                f"{f}: damaged weights file ({type(e).__name__}: {e}); resume from an earlier checkpoint"
            ) from e
    bad = _non_finite(sd)
    if bad:
        raise UserError(f"{folder}: {len(bad)} weight tensors are not finite (e.g. {bad[0]}); not loaded")
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(model, sd)
        unexpected = getattr(res, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{folder}: unexpected adapter keys {unexpected[:5]}")
        return
    from torch.distributed.tensor.experimental import implicit_replication

    from common.core.models import full_parameters

    # ZeRO-3: parameters are partitioned from loading on; --tp-size: each DTensor keeps its shard of the full tensor
    with full_parameters(model, modify=True), implicit_replication():
        try:
            missing, unexpected = model.load_state_dict(sd, strict=False)
        except RuntimeError as e:  # "size mismatch for ...": weights of another model
            first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
            raise UserError(
                f"{folder}: these weights are of another model than --model-name-or-path ({first}); pass the "
                "model the run started from"
            ) from e
    tied = set(getattr(model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UserError(
            f"{folder}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
