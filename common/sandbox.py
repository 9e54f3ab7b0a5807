"""The tools an environment offers the policy (common/envs.py): a calculator and a Python runner.

The Python tool runs the model's code in a child process. What it guarantees (each tested in tests/test_envs.py):
  - wall-clock limit: the child is killed (its whole process group) after `timeout` seconds;
  - CPU limit: RLIMIT_CPU of `timeout` seconds (a busy loop gets SIGXCPU even if the clock were not checked);
  - memory limit: RLIMIT_AS of `memory_mb` (an allocation past it is a MemoryError in the child);
  - an empty environment: no variable of the trainer (tokens, keys, paths) reaches the child;
  - a private working directory, created empty for the call and deleted after it;
  - no file written outside that directory, no process started, no socket opened: a Python audit hook installed
    before the model's code runs refuses `open` for writing outside the directory, `os.remove`/`rename`/`mkdir`/...
    outside it, `subprocess`/`os.system`/`os.exec*`/`os.fork`, `socket.connect`/`bind`, and `ctypes`;
  - output cut to `max_chars` characters (stdout and stderr go to a file capped by RLIMIT_FSIZE, so a printing loop
    cannot fill the memory or the disk).
What it does not guarantee: it is not a security boundary against hostile native code. An audit hook is
Python-level: a C extension module that the child can import and that writes files or opens sockets without
Python's audited calls is not stopped (the extensions of the standard library's own `_posixsubprocess`, `_socket`
and `_ctypes` are refused at import). Reads are not restricted (the child can read files the trainer can read), the
network is not cut at the OS level, and the child runs as the trainer's user. For untrusted models at scale run
the tool in a container or a VM (e.g. a service the environment calls).
"""

from __future__ import annotations

import ast
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# ---------------------------------------------------------------------------------------------
# Calculator: arithmetic on numbers only, evaluated on the syntax tree (never eval)
# ---------------------------------------------------------------------------------------------
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses on numbers), as text; an error
    message for anything else. Exponents are bounded (|b| <= 100) so `9**9**9` cannot hang the trainer."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](a, b)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = ev(ast.parse(str(expression).replace("^", "**"), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Python: the model's code in a limited child process
# ---------------------------------------------------------------------------------------------
# Runs in the child before the model's code: the audit hook (it cannot be removed once added).
_GUARD = r"""
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_WRITE_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                 "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_DENY = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
         "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.cdata",
         "os.kill", "os.killpg", "signal.pthread_kill"}
_DENY_MODULES = {"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket"}

def _inside(path):
    try:
        p = os.fspath(path)
    except TypeError:
        return True  # a file descriptor: already opened
    if isinstance(p, bytes):
        p = p.decode(errors="replace")
    return os.path.realpath(os.path.join(_ROOT, p)).startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _DENY or event.startswith("os.exec") or event.startswith("os.spawn"):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args and str(args[0]).split(".")[0] in _DENY_MODULES:
        raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
    if event == "open" and len(args) > 1:
        mode = args[1] if isinstance(args[1], str) else ""
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writes = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        if writes and not _inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory")
    if event in _WRITE_EVENTS and args and not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
        raise PermissionError(f"sandbox: {event} outside the working directory")

sys.addaudithook(_hook)
del _hook
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


def _limits(timeout: float, memory_mb: int, max_file_bytes: int):
    """preexec_fn of the child: its own process group (killed whole), CPU, address space and file-size limits."""

    def apply():
        import resource

        os.setsid()
        cpu = max(1, int(timeout + 1))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_chars: int = 1000) -> tuple[str, bool]:
    """Run `code` in a limited child process (module docstring). Returns (its output: stdout and stderr, cut to
    `max_chars`, or what stopped it; ok: it exited 0 within its limits)."""
    workdir = tempfile.mkdtemp(prefix="cleanrlhf_tool_")
    out_path = os.path.join(workdir, ".output")
    ok, note = False, ""
    try:
        with open(out_path, "wb") as out:
            # -I: isolated (no PYTHON* variables, no user site, no script dir on sys.path); -S: no site module
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env={},  # nothing of the trainer's environment
                preexec_fn=_limits(timeout, memory_mb, max(4 * max_chars, 1 << 16)),
                close_fds=True,
            )
            t0 = time.monotonic()
            try:
                child.communicate(code.encode(), timeout=timeout)
                ok = child.returncode == 0
                if child.returncode < 0:
                    note = f"[killed by signal {signal.Signals(-child.returncode).name}]"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                note = f"[timed out after {time.monotonic() - t0:.1f} s]"
        with open(out_path, "rb") as f:
            text = f.read(max_chars + 1).decode(errors="replace")
        if len(text) > max_chars:
            text = text[:max_chars] + "\n[output truncated]"
        return (text + ("\n" if text and note else "") + note).strip(), ok
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
