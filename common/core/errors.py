"""The floor of common/: user errors. Imports only the standard library at its top (and common.core.seeds, which
does too), so every module may import it, and the Python tool's sandbox starts without torch.

A user error (a bad flag, path, data row or reward function) is a `UserError`; the scripts' entry point
(common.harness.cli.cli) prints its message as one line and exits 2. Tracebacks are for bugs.
"""

import sys


def user_error(message: str) -> None:
    """A user error: one line on stderr, exit code 2 (no traceback). Under torchrun / accelerate launch the line is
    printed by rank 0 only (not once per process), and every rank writes it to torchelastic's error file, so the
    launcher's failure report (which follows, and which no child can suppress) quotes it instead of '<N/A>'."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        except OSError:
            pass
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:  # rank 0 meets the same check at the same moment: the launcher ends the others once one rank exits, so a
        time.sleep(1.0)  # rank that is not 0 waits a moment, or rank 0 may be ended before its line (seen in CI)
    raise SystemExit(2)


class UserError(ValueError):
    """Bad input from the user (a flag, a path, a data row, a reward function): `cli` prints its message
    as one line and exits 2. Tracebacks are for bugs (set CLEANRLHF_DEBUG=1 to see one anyway)."""


class EngineFailed(UserError):
    """The rollout engine's server failed mid-run (gone, no answer in time, a refused answer): the scripts' entry point
    checkpoints the last step trained (common.harness.run.Run.on_engine_failure), prints this one line and exits 1."""


def load_from_file(spec: str, flag: str, kind: str):
    """`path/to/file.py:name` -> the file's attribute `name` (the file imported only when asked), for the flags that
    take the user's code (--reward-fn: kind "function", --env: kind "class"). Every failure is one line naming the
    flag: no ':', no such file, the file's own import error, no such name."""
    import importlib.util
    from pathlib import Path

    path, _, name = spec.rpartition(":")
    if not path:
        raise UserError(
            f"{flag} {spec!r}: expected path/to/file.py:{'function_name' if kind == 'function' else 'Name'}"
        )
    if not Path(path).is_file():
        raise UserError(f"{flag} {spec!r}: file {path} not found")
    mod_spec = importlib.util.spec_from_file_location(
        f"_user_{flag.strip('-').replace('-', '_')}_{Path(path).stem}", path
    )
    module = importlib.util.module_from_spec(mod_spec)
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: its own error, one line, naming the file
        raise UserError(f"{flag} {spec!r}: {path} failed to import: {type(e).__name__}: {e}") from e
    if getattr(module, name, None) is None:
        raise UserError(f"{flag} {spec!r}: {path} has no {kind} {name!r}")
    return getattr(module, name)


# the seeds moved to common.core.seeds; these names stay for users' copies of the scripts
from common.core.seeds import mix_seed, seed_everything  # noqa: E402, F401
