"""Walking a script's Args and its flag groups (common.harness.args): every flag by its flat name (flags_of), the
flat {flag: value} view that args.json, checkpoints, trackers and presets use (flat_args), the values filled at run
time, the flags a resume may change, and each flag's own checks (check_args)."""

from __future__ import annotations

import dataclasses
import math
import typing

import tyro

from common.core.errors import UserError
from common.harness.args import RESUME_MAY_CHANGE, Check


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, include_extras=True)


def _metadata(hint) -> tuple:
    return getattr(hint, "__metadata__", ())


def is_group(hint) -> bool:
    return tyro.conf.OmitArgPrefixes in _metadata(hint)


def flags_of(cls, prefix: str = "") -> dict:
    """{field name (a flag's name with _): (field, type hint, owner class)} of every flag of an Args class, its
    groups' fields by their own flat names; a prefixed nested dataclass (`health`) as one entry."""
    out, hints = {}, _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if is_group(hints[f.name]):
            out.update(flags_of(_group_type(hints[f.name]), prefix))
        else:
            out[prefix + f.name] = (f, hints[f.name], cls)
    return out


def _group_type(hint):
    return typing.get_args(hint)[0] if typing.get_args(hint) else hint


def _members(args):
    """(field name, value, type hint) of an Args instance's own fields, its groups' fields in their place."""
    hints = _hints(type(args))
    for f in dataclasses.fields(args):
        if f.init and is_group(hints[f.name]):
            yield from _members(getattr(args, f.name))
        elif f.init:
            yield f.name, getattr(args, f.name), hints[f.name]


def _values(args, prefix: str = ""):
    """(flag name, value, type hint) of every leaf flag of an Args instance, nested prefixed groups included."""
    for name, v, hint in _members(args):
        if dataclasses.is_dataclass(v):
            yield from _values(v, f"{prefix}{name}.")
        else:
            yield prefix + name, v, hint


def flat_args(args) -> dict:
    """The flags of an Args as a flat {name: value} (groups merged; a prefixed nested dataclass as a dict), in JSON
    values: what args.json, trainer_state.pt and W&B record, keyed as the flags are."""
    import json

    out = {name: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for name, v, _ in _members(args)}
    return json.loads(json.dumps(out, default=str))


def runtime_values(args) -> dict:
    """A script's values filled at run time (its Args fields with init=False, e.g. GRPO's old_logprobs_from)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if not f.init}


def resume_may_change(args) -> set[str]:
    """Names of the flags marked RESUME_MAY_CHANGE."""
    return {name for name, (_, hint, _) in flags_of(type(args)).items() if RESUME_MAY_CHANGE in _metadata(hint)}


def check_args(args) -> None:
    """Every flag's own rules (its Checks), and every float finite, before anything loads: one line naming the flag."""
    for name, v, hint in _values(args):
        flag = "--" + name.replace("_", "-")
        # a float flag is a number a run computes with: nan or inf (a preset's `.inf`) would reach the weights
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, float) and not math.isfinite(x):
                raise UserError(f"{flag} {x}: must be a finite number")
        for rule in _metadata(hint):
            if isinstance(rule, Check):
                rule(flag, v)
