"""Flags: `--config` presets, then the command line, parsed by tyro; each flag's own checks (common.harness.args); the
scripts' entry point `cli(main, Args)`, which turns a UserError into one line and exit code 2."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from common.core.errors import EngineFailed, UserError, user_error
from common.harness.flags import check_args, flags_of


def parse_args(cls, argv: list[str] | None = None):
    """tyro.cli(cls), where `--config PATH` (YAML, keys = field names with - or _) sets values that
    the other CLI flags then override. The preset's values are turned into CLI flags and parsed by
    tyro with the fields' types, exactly as if typed: `learning_rate: 1e-5` is a float (YAML 1.1 alone
    reads it as a string), a Literal's choices are checked, nested groups (`health: {kl_max: 1}`) work.
    An unknown key is an error naming the file, the key and the valid names."""
    import yaml

    argv = _drop_retired(list(sys.argv[1:] if argv is None else argv), "")
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
            cfg = {
                k: v
                for k, v in cfg.items()
                if _drop_retired([f"--{str(k).replace('_', '-')}"], f"--config {path}: ")  # kept unless retired
            }
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

    list_flags = {"--" + name.replace("_", "-") for name, (_, hint, _) in flags_of(cls).items() if is_list(hint)}
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


# Flags that did nothing for a while and were removed: still accepted (earlier commands and presets run), with a note.
RETIRED_FLAGS = {
    "--values-from-update": "PPO's V_old is always the critic's no-grad values pass (issue 31); the flag had no effect"
}


def _drop_retired(argv: list[str], where: str) -> list[str]:
    """argv without the retired flags (and a value that follows one), each named once on stderr."""
    out, skip = [], False
    for a in argv:
        name = a.split("=", 1)[0]
        flag = name.replace("--no-", "--", 1) if name.startswith("--no-") else name
        if skip:
            skip = False
            if not a.startswith("--"):
                continue
        if flag in RETIRED_FLAGS:
            print(f"[cleanrlhf] {where}{name}: retired, ignored ({RETIRED_FLAGS[flag]})", file=sys.stderr)
            skip = "=" not in a
            continue
        out.append(a)
    return out


def cli(main, cls):
    """The scripts' entry point: parse the flags (presets included), check their ranges, run `main`, and
    turn a UserError (and our data/reward errors, which are UserErrors) into one line on stderr with
    exit code 2."""
    args = parse_args(cls)
    try:
        check_args(args)
        return main(args)
    except EngineFailed as e:  # mid-run: the last step trained is checkpointed first
        if os.environ.get("CLEANRLHF_DEBUG"):
            raise
        from common.harness.run import end_on_engine_failure

        _stop_reward_workers()
        end_on_engine_failure(e)
    except UserError as e:
        if os.environ.get("CLEANRLHF_DEBUG"):
            raise
        _stop_reward_workers()
        user_error(f"error: {e}")


def _stop_reward_workers() -> None:
    """The --reward-fn worker pools stopped before a run ends on an error (reward_workers.stop_all_pools: why)."""
    if "common.core.reward_workers" in sys.modules:
        sys.modules["common.core.reward_workers"].stop_all_pools()


class _redirect_stderr:
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        self.old, sys.stderr = sys.stderr, self.f

    def __exit__(self, *exc):
        sys.stderr = self.old


def _preset_flags(cls, cfg: dict, path: str, prefix: str = "") -> list[str]:
    """A preset mapping -> the CLI flags that say the same (`learning_rate: 1e-5` -> `--learning-rate 1e-5`). Keys
    are flag names, flat over the shared groups (common.harness.args), as before the groups existed."""
    fields = flags_of(cls)
    # flag aliases (tyro.conf.arg(aliases=...): --ppo-epochs, --num-samples, ...) work as keys too
    aliases = {
        alias.lstrip("-").replace("-", "_"): name
        for name, (_, hint, _) in fields.items()
        for meta in getattr(hint, "__metadata__", ())
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
        f, hint, _ = fields[name]
        if (
            isinstance(value, dict)
            and f.default_factory is not dataclasses.MISSING
            and dataclasses.is_dataclass(_strip(hint))
        ):
            flags += _preset_flags(type(f.default_factory()), value, path, prefix=f"{prefix}{name}.")
        elif isinstance(value, bool) and _strip(hint) is bool:
            flags.append(flag if value else f"--{prefix}no-{name}".replace("_", "-"))  # tyro: --x / --no-x
        elif value is None:
            flags += [flag, "None"]
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def _strip(hint):
    """The type under Annotated[...] layers."""
    while getattr(hint, "__metadata__", None) is not None:
        hint = hint.__origin__
    return hint
