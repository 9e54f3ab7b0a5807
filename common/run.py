"""Run plumbing shared by every script: config presets, seeding, the run folder, metrics and
W&B tracking, checkpoints and exact resume.

Run folder: runs/{algo}__{exp_name}__{seed}__{unix_time}/
    args.json        every Args field, world_size, distributed_type, git commit/dirty, library versions
    metrics.jsonl    one JSON object per logged step
    samples.jsonl    a few (prompt, response, reward) rows per log interval
    checkpoints/step_{N}/   save_pretrained folders + trainer_state.pt
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# Args: --config presets, then CLI flags
# ---------------------------------------------------------------------------------------------
def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), where `--config PATH` (YAML, keys = field names with - or _) sets the defaults
    that the other CLI flags then override. An unknown key is an error naming the file and key."""
    import tyro
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    default = None
    for i, a in enumerate(argv):
        path = argv[i + 1] if a == "--config" and i + 1 < len(argv) else a.split("=", 1)[1] if a.startswith("--config=") else None
        if path:
            if not Path(path).is_file():
                raise SystemExit(f"--config {path}: file not found")
            cfg = {k.replace("-", "_"): v for k, v in (yaml.safe_load(open(path)) or {}).items()}
            names = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(cfg) - names)
            if unknown:
                raise SystemExit(f"--config {path}: unknown key(s) {unknown}; see --help for valid names")
            for f in dataclasses.fields(cls):  # nested groups (e.g. health:) come as dicts
                if f.name in cfg and isinstance(cfg[f.name], dict) and f.default_factory is not dataclasses.MISSING:
                    cfg[f.name] = dataclasses.replace(f.default_factory(), **{k.replace("-", "_"): v for k, v in cfg[f.name].items()})
            default = cls(**{**cfg, "config": path})
            break
    return tyro.cli(cls, default=default, args=argv)


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so models initialise identically; per-sample randomness is derived
    from (seed, step, sample id) explicitly (common.rollout.sample_seed)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


# ---------------------------------------------------------------------------------------------
# Run folder and tracking
# ---------------------------------------------------------------------------------------------
def _git(*cmd) -> str:
    try:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        return ""


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "peft", "datasets", "tyro", "wandb"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def make_run_dir(accelerator, algo: str, args) -> Path:
    """Named once on the main process (its clock) and shared with every rank."""
    from accelerate.utils import broadcast_object_list

    name = [f"{algo}__{args.exp_name}__{args.seed}__{int(time.time())}"]
    if accelerator.num_processes > 1:
        broadcast_object_list(name, from_process=0)
    run_dir = Path(args.output_dir) / name[0]
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=False)
        record = {**dataclasses.asdict(args), "world_size": accelerator.num_processes,
                  "distributed_type": str(accelerator.distributed_type).split(".")[-1],  # NO, MULTI_GPU, FSDP, DEEPSPEED...
                  "zero_stage": getattr(accelerator.state.deepspeed_plugin, "zero_stage", None),
                  "git_commit": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain")),
                  "versions": library_versions(), "argv": sys.argv}
        (run_dir / "args.json").write_text(json.dumps(record, indent=2, default=str))
    accelerator.wait_for_everyone()
    return run_dir


class Tracker:
    """metrics.jsonl (always), samples.jsonl, W&B (--track), and a rich progress line. Main process only."""

    SHOW = ("train/reward", "train/kl", "train/kl_coef", "eval/accuracy", "loss/policy", "loss/sft", "loss/rm",
            "rm/accuracy", "rewards/accuracy", "eval/loss", "perf/step_s")

    def __init__(self, accelerator, args, run_dir: Path, total_steps: int, start_step: int = 0):
        self.main = accelerator.is_main_process
        self.run_dir = run_dir
        self.wandb = None
        self.progress = None
        if not self.main:
            return
        if args.track:
            import wandb

            tags = [t for t in os.environ.get("WANDB_TAGS", "").split(",") if t]
            commit = _git("rev-parse", "--short", "HEAD")
            self.wandb = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_dir.name,
                                    group=args.exp_name, config=dataclasses.asdict(args), dir=str(run_dir),
                                    tags=tags + ([f"commit-{commit}"] if commit else []), save_code=True)
            self.wandb.define_metric("train/step")
            self.wandb.define_metric("*", step_metric="train/step")
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
                                 disable=not sys.stdout.isatty())
        self.task = self.progress.add_task(run_dir.name.split("__")[0], total=total_steps, completed=start_step, metrics="")
        self.progress.start()

    def log(self, step: int, metrics: dict) -> None:
        if not self.main:
            return
        row = {"step": step, **{k: (float(v) if not isinstance(v, str) else v) for k, v in metrics.items()}}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({**row, "train/step": step})
        shown = "  ".join(f"{k}={row[k]:.4g}" for k in self.SHOW if k in row)
        self.progress.update(self.task, completed=step, metrics=shown)
        if not sys.stdout.isatty():
            print(f"step {step}: {shown}", flush=True)

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.main or not rows:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        if self.wandb is not None:
            import wandb

            cols = list(rows[0])
            self.wandb.log({"samples": wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in rows]),
                            "train/step": step})

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.wandb is not None:
            self.wandb.finish()


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
def save_checkpoint(accelerator, run_dir: Path, step: int, models: dict, state: dict, keep_last: int = 0) -> Path:
    """checkpoints/step_{step}/{name}/ (save_pretrained) for each model + trainer_state.pt.

    Written into a temp folder and renamed at the end, so a crash mid-save leaves the previous
    checkpoints untouched and no half checkpoint under a step_ name. `keep_last` > 0 deletes older ones."""
    from accelerate.utils import broadcast_object_list

    from common.distributed import reshard, save_engine_states

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step}"
    for m in models.values():
        reshard(m)  # FSDP2: units left unsharded by a no_grad forward back to DTensor shards
    state_dicts = {name: _drop_tied_copies(accelerator.unwrap_model(m), accelerator.get_state_dict(m))  # collective under FSDP/ZeRO-3
                   for name, m in models.items()}
    tmp = [None]
    if accelerator.is_main_process:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = [tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=ckpt_root)]
    if accelerator.num_processes > 1:
        broadcast_object_list(tmp, from_process=0)  # DeepSpeed: every rank writes its shards there
    tmp = Path(tmp[0])
    save_engine_states(accelerator, tmp, models)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, m in models.items():
            accelerator.unwrap_model(m).save_pretrained(tmp / name, state_dict=state_dicts[name], safe_serialization=True)
        torch.save({**state, "rng": rng_state(), "step": step}, tmp / "trainer_state.pt")
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        if keep_last > 0:
            for old in sorted(list_checkpoints(run_dir), key=_step_of)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _drop_tied_copies(model, state_dict: dict) -> dict:
    """Keep one name per tied parameter (e.g. lm_head.weight = embed_tokens.weight). save_pretrained
    spots ties by shared storage, but under FSDP2 / ZeRO-3 the gathered state dict holds separate
    copies, so the folder would carry the tensor twice."""
    first = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    aliases = {name for name, p in model.named_parameters(remove_duplicate=False) if first[id(p)] != name}
    return {k: v for k, v in state_dict.items() if k not in aliases} if state_dict is not None else state_dict


def _step_of(p: Path) -> int:
    return int(p.name.split("_")[1])


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit()
            and (p / "trainer_state.pt").exists()]


def resolve_checkpoint(path: str) -> Path:
    """A checkpoint folder, or a run folder (its latest complete checkpoint)."""
    p = Path(path)
    if (p / "trainer_state.pt").exists():
        return p
    ckpts = list_checkpoints(p)
    if not ckpts:
        raise FileNotFoundError(f"--resume {path}: no complete checkpoint (checkpoints/step_N/trainer_state.pt) found")
    return max(ckpts, key=_step_of)


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", weights_only=True)


def load_weights(model, folder: Path) -> None:
    """Load a save_pretrained folder's weights into an already-built (possibly peft) model in place."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(f))
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(model, sd)
        unexpected = getattr(res, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"{folder}: unexpected adapter keys {unexpected[:5]}")
        return
    from common.models import full_parameters

    with full_parameters(model, modify=True):  # ZeRO-3: parameters are partitioned from loading on
        missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def peak_mem_gb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux -> GiB
    except Exception:
        return math.nan
