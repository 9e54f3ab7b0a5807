"""Flags: `--config` presets, then the command line, parsed by tyro; range checks; the scripts' entry point
`cli(main, Args)`, which turns a UserError into one line and exit code 2."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

from common.errors import UserError, user_error


def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), where `--config PATH` (YAML, keys = field names with - or _) sets values that
    the other CLI flags then override. The preset's values are turned into CLI flags and parsed by
    tyro with the fields' types, exactly as if typed: `learning_rate: 1e-5` is a float (YAML 1.1 alone
    reads it as a string), a Literal's choices are checked, nested groups (`health: {kl_max: 1}`) work.
    An unknown key is an error naming the file, the key and the valid names."""
    import yaml

    argv = list(sys.argv[1:] if argv is None else argv)
    for a in argv:
        for theirs, ours in FOREIGN_FLAGS.items():
            if a == theirs or a.startswith(theirs + "="):
                user_error(f"{theirs}: not a cleanrlhf flag; {ours}")
    doc = (
        (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    )  # --help starts with the script's summary
    preset = []
    for i, a in enumerate(argv):
        path = (
            argv[i + 1]
            if a == "--config" and i + 1 < len(argv)
            else a.split("=", 1)[1]
            if a.startswith("--config=")
            else None
        )
        if path:
            if not Path(path).is_file():
                user_error(f"--config {path}: file not found")
            try:
                cfg = yaml.safe_load(open(path)) or {}
            except yaml.YAMLError as e:
                user_error(f"--config {path}: not valid YAML ({' '.join(str(e).split())})")
            if not isinstance(cfg, dict):
                user_error(f"--config {path}: expected a mapping of field names to values")
            preset = _preset_flags(cls, cfg, path)
            _tyro_cli(
                cls, preset, blame=f"--config {path}: "
            )  # the preset alone first, so a bad value is blamed on the file
            break
    argv = _merge_repeated_list_flags(cls, argv)
    return _tyro_cli(cls, preset + argv, description=doc)  # later flags win: the CLI overrides the preset


def _tyro_cli(cls, args: list[str], description: str | None = None, blame: str = ""):
    """tyro.cli, with its parse errors as one line: tyro draws a box (message, suggestions, help
    pointer); we keep the message and the first suggestion. --help is untouched (stdout, exit 0)."""
    import io

    import tyro

    buf = io.StringIO()
    try:
        with _redirect_stderr(buf):
            return tyro.cli(cls, args=args, description=description)
    except SystemExit as e:
        text = buf.getvalue()
        if e.code in (0, None) or not text.strip():
            sys.stderr.write(text)
            raise
        # the box: unicode (╭─ title ─╮, │ lines │) or plain (title, a line of dashes, lines)
        lines = [line for line in text.splitlines() if line.strip()]
        inner = lambda line: line.strip().strip("│|").strip()
        is_rule = lambda line: line.strip()[:1] in "╭╰" or set(inner(line)) <= set("─-━=+ ")
        if len(lines) > 1 and not is_rule(lines[0]) and is_rule(lines[1]):
            lines = lines[1:]  # a plain box's title line
        sections, current = [], []
        for line in lines + ["-"]:
            if is_rule(line):
                if current:
                    sections.append(current)
                current = []
            else:
                current.append(inner(line))
        message = " ".join(sections[0]) if sections else text.strip()
        hint = next(
            (s[1].split()[0] for s in sections[1:] if s[0].startswith("Perhaps you meant") and len(s) > 1), None
        )
        user_error(f"error: {blame}{message}" + (f"; perhaps you meant {hint}" if hint else "") + " (see --help)")


def _merge_repeated_list_flags(cls, argv: list[str]) -> list[str]:
    """`--reward-fn a.py:f --reward-fn b.py:g` -> `--reward-fn a.py:f b.py:g` for list-typed fields (tyro
    alone would keep only the last). Other flags are left as they are."""
    import typing

    def is_list(t):
        return t is list or typing.get_origin(t) is list or any(is_list(a) for a in typing.get_args(t))

    list_flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.init and is_list(f.type)}
    out, first_end = [], {}
    i = 0
    while i < len(argv):
        a = argv[i]
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        if a in list_flags and a in first_end:  # a repeat: its values go after the first occurrence's
            pos = first_end[a]
            out[pos:pos] = argv[i + 1 : j]
            for k in first_end:
                first_end[k] += (j - i - 1) if first_end[k] >= pos and k != a else 0
            first_end[a] = pos + (j - i - 1)
        else:
            if a in list_flags:
                first_end[a] = len(out) + (j - i)
            out += argv[i:j]
        i = j
    return out


# Flags users bring from TRL / verl that have no exact equivalent here: one line saying which of ours to use.
# (Exact equivalents are aliases on the fields themselves: --num-generations, --beta, --max-completion-length.)
FOREIGN_FLAGS = {
    "--per-device-train-batch-size": "batch flags here are global over processes: --micro-batch-size is the per-process "
    "forward/backward size, --batch-size (PPO, DPO, SFT, RM) or --num-prompts (GRPO) the "
    "samples per step over all processes",
    "--gradient-accumulation-steps": "accumulation follows from the sizes: --mini-batch-size (or --batch-size) over "
    "--micro-batch-size x processes",
}


# Range checks of the flags every script shares by name, made before anything loads.
POSITIVE = (
    "batch_size",
    "mini_batch_size",
    "micro_batch_size",
    "total_steps",
    "max_new_tokens",
    "group_size",
    "num_prompts",
    "update_epochs",
    "log_every",
    "num_samples",
    "max_length",
    "max_prompt_length",
    "max_completion_length",
    "learning_rate",
    "critic_learning_rate",
    "clip_eps",
    "clip_eps_low",
    "clip_eps_high",
    "clip_eps_value",
    "beta_max",
    "policy_kl_target",
    "lora_alpha",
    "samples",
    "train_size",
    "test_size",
    "vllm_kv_cache_gb",
    "vllm_tensor_parallel_size",
)
NON_NEGATIVE = (
    "save_every",
    "eval_every",
    "keep_last",
    "warmup_steps",
    "lora_r",
    "top_k",
    "num_eval_prompts",
    "num_eval_pairs",
    "num_eval_examples",
    "num_samples_logged",
    "kl_coef",
    "ent_coef",
    "vf_coef",
    "weight_decay",
    "critic_warmup_steps",
    "overlong_buffer",
    "max_resample_rounds",
    "missing_eos_penalty",
    "tis_cap",
    "sft_coef",
    "label_smoothing",
    "save_every_minutes",
    "max_wall_minutes",
    "max_grad_norm",
    "beta_min",
    "reward_timeout",
    "reward_workers",
    "n",
)


def check_args(args) -> None:
    """One line naming the flag and the valid range for a value no run could use."""

    def flag(name):
        return "--" + name.replace("_", "-")

    # a float flag is a number a run computes with: nan or inf (a preset's `.inf`) would reach the weights
    for owner, prefix in [(args, "")] + [
        (v, f"{f.name}.") for f in dataclasses.fields(args) if dataclasses.is_dataclass(v := getattr(args, f.name))
    ]:
        for f in dataclasses.fields(owner):
            v = getattr(owner, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{flag(prefix + f.name)} {v}: must be a finite number")
    for name in POSITIVE:
        v = getattr(args, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v > 0:
            raise UserError(f"{flag(name)} {v}: must be > 0")
    for name in NON_NEGATIVE:
        v = getattr(args, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= 0:
            raise UserError(f"{flag(name)} {v}: must be >= 0")
    out = getattr(args, "output_dir", None)
    if out is not None:
        p = Path(out)
        if p.is_symlink() and not p.exists():
            raise UserError(f"--output-dir {out}: a symlink to nothing ({os.readlink(p)}); point it at a folder")
        if p.exists() and not p.is_dir():
            raise UserError(f"--output-dir {out}: a file, not a folder")
        existing = next((q for q in [p, *p.parents] if q.exists()), None)
        if existing is not None and existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
            raise UserError(f"--output-dir {out}: {existing} cannot be written (permissions)")
    if not 0 < getattr(args, "vllm_gpu_memory_utilization", 0.5) <= 1:
        raise UserError(
            f"--vllm-gpu-memory-utilization {args.vllm_gpu_memory_utilization}: must be in (0, 1] (a share of "
            "the GPU's memory)"
        )
    greedy_at_zero = any(
        f.name == "temperature" and f.default == 0 for f in dataclasses.fields(args)
    )  # evaluate: 0 = greedy
    if getattr(args, "temperature", 1.0) < 0 or (not greedy_at_zero and getattr(args, "temperature", 1.0) == 0):
        raise UserError(f"--temperature {args.temperature}: must be > 0 (sampling; evaluation is greedy already)")
    if getattr(args, "sample_temperature", 1.0) <= 0:
        raise UserError(
            f"--sample-temperature {args.sample_temperature}: must be > 0 (greedy accuracy is always reported)"
        )
    if not 0 < getattr(args, "top_p", 1.0) <= 1:
        raise UserError(f"--top-p {args.top_p}: must be in (0, 1]")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name, 1.0) <= 1:
            raise UserError(f"{flag(name)} {getattr(args, name)}: must be in [0, 1]")
    fallback = getattr(args, "reward_fallback", None)
    if fallback is not None and not math.isfinite(fallback):
        raise UserError(f"--reward-fallback {fallback}: must be a finite number (it replaces a failed reward)")
    if getattr(args, "label_smoothing", 0.0) >= 0.5:
        raise UserError(f"--label-smoothing {args.label_smoothing}: must be < 0.5")


def cli(main, cls):
    """The scripts' entry point: parse the flags (presets included), check their ranges, run `main`, and
    turn a UserError (and our data/reward errors, which are UserErrors) into one line on stderr with
    exit code 2."""
    args = parse_args(cls)
    try:
        check_args(args)
        return main(args)
    except UserError as e:
        if os.environ.get("CLEANRLHF_DEBUG"):
            raise
        user_error(f"error: {e}")


class _redirect_stderr:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        self.old, sys.stderr = sys.stderr, self.f

    def __exit__(self, *exc):
        sys.stderr = self.old


def _preset_flags(cls, cfg: dict, path: str, prefix: str = "") -> list[str]:
    """A preset mapping -> the CLI flags that say the same (`learning_rate: 1e-5` -> `--learning-rate 1e-5`)."""
    import typing

    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    # flag aliases (tyro.conf.arg(aliases=...): --ppo-epochs, --num-samples, ...) work as keys too
    hints = typing.get_type_hints(cls, include_extras=True)
    aliases = {
        alias.lstrip("-").replace("-", "_"): name
        for name in fields
        for meta in getattr(hints.get(name), "__metadata__", ())
        for alias in getattr(meta, "aliases", None) or ()
    }
    flags, seen = [], {}
    for key, value in cfg.items():
        name = str(key).replace("-", "_")
        name = aliases.get(name, name)
        if name in seen:  # YAML keeps the last of two keys for one field without a word: say it
            user_error(
                f"--config {path}: keys {prefix + seen[name]!r} and {prefix + str(key)!r} set the same field; keep one"
            )
        seen[name] = str(key)
        if name not in fields:
            valid = ", ".join(sorted(fields))
            user_error(f"--config {path}: unknown key {prefix + str(key)!r}; valid keys: {valid}")
        flag = "--" + (prefix + name).replace("_", "-")
        f = fields[name]
        if isinstance(value, dict) and dataclasses.is_dataclass(
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        ):
            flags += _preset_flags(type(f.default_factory()), value, path, prefix=f"{prefix}{name}.")
        elif isinstance(value, bool) and f.type in (bool, "bool"):
            flags.append(flag if value else f"--{prefix}no-{name}".replace("_", "-"))  # tyro: --x / --no-x
        elif value is None:
            flags += [flag, "None"]
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags
