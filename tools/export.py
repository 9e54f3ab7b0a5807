"""Turn a checkpoint into a clean model folder: weights (LoRA merged), config, generation config,
tokenizer and chat template, and a model card (README.md) listing the run's args and final metrics.

    python -m tools.export runs/ppo_llm__.../checkpoints/step_100/policy --out exported/ppo-step100
    python -m tools.export runs/ppo_llm__...  --out exported/ppo-last          # a run folder: latest checkpoint's
    policy python -m tools.export CKPT --out DIR --push-to-hub user/my-model           # then upload (needs internet)

The folder loads with `AutoModelForCausalLM.from_pretrained(DIR)` / `AutoTokenizer.from_pretrained(DIR)`,
vLLM and TGI, no peft needed. `--push-to-hub` uploads it with huggingface_hub (a hub token in the
environment); offline (HF_HUB_OFFLINE=1) it stops with a message and the local folder stays.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import tyro

from common.core.errors import UserError
from common.harness.checkpoint import list_checkpoints


@dataclass
class Args:
    checkpoint: tyro.conf.Positional[str]
    """checkpoints/step_N/<model>, checkpoints/step_N (its policy), or a run folder (its latest checkpoint)"""
    out: str = "exported"
    """output folder (created; must not exist yet, or be empty)"""
    model: str = "policy"
    """which model of the checkpoint when given a step or run folder (policy, critic, model)"""
    push_to_hub: Optional[str] = None
    """hub repo id to upload the folder to (needs internet and a token)"""


def find_model_folder(path: str, model: str = "policy") -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"{path}: no such file or folder")
    if (p / "config.json").exists() or (p / "adapter_config.json").exists():
        return p
    if (p / "trainer_state.pt").exists():
        step_dir = p
    else:
        ckpts = list_checkpoints(p)
        if not ckpts:
            raise UserError(
                f"{path}: not a model folder, a checkpoint (checkpoints/step_N) or a run folder with checkpoints"
            )
        step_dir = max(ckpts, key=lambda c: int(c.name.split("_")[1]))
    if not (step_dir / model).is_dir():
        have = sorted(d.name for d in step_dir.iterdir() if d.is_dir())
        raise UserError(f"{step_dir}: no model {model!r} (has {have}); pass --model")
    return step_dir / model


# what a model folder for the Hub holds: safetensors weights, configs, tokenizer files (no pickles, no stray files)
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "tokenizer*",
               "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "chat_template*", "*.model")  # fmt: skip


def is_model_file(name: str) -> bool:
    import fnmatch

    return any(fnmatch.fnmatch(name, pattern) for pattern in MODEL_FILES)


def model_card(folder: Path, run_dir: Path | None) -> str:
    lines = [
        f"# {run_dir.name if run_dir else folder.name}",
        "",
        "Trained with cleanrlhf (one PyTorch script per RL post-training algorithm).",
        "",
    ]
    if run_dir is not None and (run_dir / "args.json").exists():
        args = json.loads((run_dir / "args.json").read_text())
        lines += [
            f"Run folder: `{run_dir.name}`, checkpoint `{folder.parent.name}`.",
            "",
            "## Arguments",
            "",
            "| flag | value |",
            "|---|---|",
        ]
        for k, v in args.items():
            if k not in ("versions", "argv", "resumes"):
                lines.append(f"| `{k}` | `{json.dumps(v, default=str)}` |")
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            step = int(folder.parent.name.split("_")[1]) if folder.parent.name.startswith("step_") else None
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            rows = [r for r in rows if step is None or r["step"] <= step]
            final = {}
            for r in rows:  # the last value of each metric up to this checkpoint
                final.update({k: (r["step"], v) for k, v in r.items() if k != "step"})
            lines += [
                "",
                "## Metrics (last value up to this checkpoint)",
                "",
                "| metric | step | value |",
                "|---|---|---|",
            ]
            lines += [
                f"| `{k}` | {s} | {v:.4g} |" if isinstance(v, float) else f"| `{k}` | {s} | {v} |"
                for k, (s, v) in sorted(final.items())
                if not k.startswith("perf/")
            ]
    return "\n".join(lines) + "\n"


def main(args: Args) -> Path:
    from common.core import hub as M

    folder = find_model_folder(args.checkpoint, args.model)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out}: exists and is not empty; nothing was written")
    src = Path(M.resolve_model_path(str(folder)))  # a LoRA adapter: merged onto its base (cached)
    run_dir = folder.parent.parent.parent if folder.parent.name.startswith("step_") else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        files = [f for f in src.iterdir() if f.is_file()]
        if not any(f.name.endswith(".safetensors") for f in files):
            raise UserError(f"{folder}: no .safetensors weights; nothing was written")
        for f in files:
            if is_model_file(f.name):
                shutil.copy2(f, tmp / f.name)
            elif f.name != "merged_from.json":  # e.g. a stray pytorch_model.bin: a pickle, not for the Hub
                print(f"left out {f.name}: not part of a safetensors model folder")
        if not (tmp / "tokenizer_config.json").exists():
            raise UserError(
                f"{folder}: no tokenizer files (a checkpoint from before tokenizers were saved); "
                f"copy them from the base model with AutoTokenizer.save_pretrained"
            )
        (tmp / "README.md").write_text(model_card(folder, run_dir))
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {folder} -> {out}")
    if args.push_to_hub:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise UserError(
                f"--push-to-hub {args.push_to_hub}: HF_HUB_OFFLINE=1, not uploading; the folder {out} is ready"
            )
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(args.push_to_hub, exist_ok=True)
        api.upload_folder(folder_path=str(out), repo_id=args.push_to_hub)
        print(f"uploaded to {args.push_to_hub}")
    return out


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
