"""The tools an environment offers the policy (common/core/envs.py): a calculator and a Python runner.

The Python tool runs the model's code in a child process, isolated by the operating system (`namespaces`, the
default; docs/agents.md has the guarantee table, each row tested in tests/*/test_envs.py):
  - its own PID namespace: it sees no other process (no /proc is mounted; the trainer has no pid it can name), and
    every process it starts dies with it (the namespace's init is killed when the call ends or times out);
  - its own mount namespace whose root holds only the standard library and the system's shared libraries, read-only
    at their own paths (wherever the interpreter lives: under /tmp, /work, a home, /opt), a few devices (/dev/null,
    zero, random, urandom), and a private size-limited tmpfs as its working directory (/work, also mounted at /tmp):
    no file of the trainer (checkpoints, tokens, other runs, the project) can be read or written;
  - its own network namespace with no interface up: no socket reaches anything; its own IPC and UTS namespaces;
  - no privilege: as root, the trainer's child runs as `nobody` (uid 65534); otherwise as the trainer's uid mapped
    to root of a new user namespace; either way with every capability dropped and no_new_privs set;
  - the limits: wall clock (the whole namespace is killed), RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (its output
    file), RLIMIT_NPROC (a fork bomb), the working directory's size (a disk filler), an empty environment;
  - a seccomp filter (x86_64): mounts, namespaces, ptrace, BPF, perf, keyrings, io_uring, userfaultfd, kexec,
    modules, raw/packet/netlink sockets fail with EPERM (seccomp_filter);
  - a Python audit hook as a further layer (refuses writes outside /work, processes, sockets, ctypes); its state lives
    in a closure, not in reachable globals.
Where the kernel refuses the namespaces (some containers), the tool refuses to start with one line naming
`--tool-sandbox audit`, the weaker mode: the audit hook and the limits only, in a fresh temporary directory of the
host, as the trainer's user. That mode is not a security boundary against hostile code (docs/agents.md).
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time

from common.core.errors import UserError

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
SANDBOXES = (
    "namespaces",
    "audit",
)  # (and --tool-sandbox remote: common/integrations/sandbox_service.py, a service's machines)
_UNSHARE_EXTRA = 0  # more unshare(2) flags (tests set an invalid one to see the refusal)
_UNAVAILABLE = 97  # the exit code of a child whose namespaces the kernel refused (and the marker it prints)
_FAILED = 98  # the exit code of a child that failed to build its new root on a path (and the marker it prints)

# The audit hook, the second layer (both modes). Its state is in a closure: the model's code cannot reach it through
# sys.modules["__main__"] (a hook, once added, cannot be removed).
_HOOK = r"""
def _install_hook(root, *more):
    import os, sys
    writes = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link",
                        "os.symlink", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"})
    deny = frozenset({"subprocess.Popen", "os.system", "os.posix_spawn", "os.fork", "os.forkpty", "socket.connect",
                      "socket.bind", "socket.sendto", "socket.getaddrinfo", "ctypes.dlopen", "ctypes.cdata",
                      "os.kill", "os.killpg", "signal.pthread_kill"})
    modules = frozenset({"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket"})
    realpath, join, fspath, sep = os.path.realpath, os.path.join, os.fspath, os.sep
    wr = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC

    def inside(path):
        try:
            p = fspath(path)
        except TypeError:
            return True  # a file descriptor: already opened
        if isinstance(p, bytes):
            p = p.decode(errors="replace")
        p = realpath(join(root, p))
        return any(p.startswith(r + sep) for r in (root, *more))

    def hook(event, args):
        if event in deny or event.startswith(("os.exec", "os.spawn")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in modules:
            raise PermissionError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open" and len(args) > 1:
            mode = args[1] if isinstance(args[1], str) else ""
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            if (any(c in mode for c in "wax+") or flags & wr) and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory")
        if event in writes and args and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes))):
            raise PermissionError(f"sandbox: {event} outside the working directory")

    sys.addaudithook(hook)
"""

# Audit mode: the child starts in a fresh host directory (its cwd), limits set by the parent (preexec_fn).
_AUDIT_MAIN = (
    _HOOK
    + r"""
import os, sys
code = sys.stdin.read()
if sys.argv[1] == "1":
    _install_hook(os.path.realpath(os.getcwd()))
del _install_hook
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
)

# Namespaces mode: this child (single-threaded, trusted code) builds the namespaces and the new root, then forks the
# namespace's init (pid 1: waits and reports), which forks the model's process (pid 2: drops every privilege, sets
# the limits, runs the code). Linux calls not in Python 3.11's os module go through ctypes (libc), before the
# model's code runs; ctypes is then removed from sys.modules.
_NS_MAIN = (
    _HOOK
    + r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.read()
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NOBODY = 65534

def call(name, *args):
    if getattr(libc, name)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{name}{args[:2]}: {os.strerror(e)}")

def unavailable(why):  # the kernel refused (namespaces, or mounts in them): the weaker mode is the way out
    print(f"cleanrlhf-sandbox-unavailable: {why}", file=sys.stderr, flush=True)
    os._exit(97)

def failed(step, path, e):  # a step of building the new root failed on a path: a fault to fix, not a refusal
    print(f"cleanrlhf-sandbox-failed: {step} {path}: {e}", file=sys.stderr, flush=True)
    os._exit(98)

REFUSED = (1, 13, 22, 28, 38, 87)  # EPERM, EACCES, EINVAL, ENOSPC (namespace count), ENOSYS, EUSERS

# 1. the namespaces. As root: without a user namespace (the model's process becomes nobody below). Otherwise, or
# where root may not: in a new user namespace. Not root: its root is the trainer's uid (the only id it may map).
# Root: its root is root (to build the new root) and its uid 1 is nobody outside (the model's process, below); a
# helper left in the parent namespaces writes that map (only a writer there may map other ids).
uid, gid = os.geteuid(), os.getegid()
base = NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS | cfg["extra"]

def map_ids(pid, uids, gids):
    for name, text in (("setgroups", "deny"), ("uid_map", uids), ("gid_map", gids)):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)

try:
    try:
        if uid != 0 or cfg["userns"]:
            raise PermissionError
        call("unshare", base)
        userns = False
    except PermissionError:
        userns = True
        if uid == 0:
            (go_r, go_w), (done_r, done_w) = os.pipe(), os.pipe()
            if os.fork() == 0:
                os.read(go_r, 1)
                map_ids(os.getppid(), f"0 0 1\n1 {NOBODY} 1", f"0 0 1\n1 {NOBODY} 1")
                os.write(done_w, b"1")
                os._exit(0)
        call("unshare", base | NEWUSER)
        if uid == 0:
            os.write(go_w, b"1")
            os.read(done_r, 1)
            os.wait()
            for fd in (go_r, go_w, done_r, done_w):  # (not the model's descriptors)
                os.close(fd)
        else:
            map_ids("self", f"0 {uid} 1", f"0 {gid} 1")
except OSError as e:
    unavailable(e)

# 2. the new root: a tmpfs holding the sandbox's own layout first (a size-limited tmpfs /work, also mounted at /tmp,
# a few devices), then read-only binds of the standard library and the shared libraries at their own paths, wherever
# they live (under /tmp, /work, a home, /opt: a bind under /tmp or /work lands inside the work tmpfs, in a root-owned
# folder, and never collides with the layout); pivot_root into it and detach the old root.
def flags_of(path):  # a remount keeps the flags the source mount has (the kernel locks them in a user namespace)
    f = os.statvfs(path).f_flag
    return sum(m for st, m in ((2, NOSUID), (4, NODEV), (8, NOEXEC), (1024, 1024), (2048, 2048), (4096, 1 << 21))
               if f & st)

def bind(src, new, writable=False):
    dst = new + src
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    call("mount", src.encode(), dst.encode(), None, BIND | REC, None)
    if not writable:
        call("mount", None, dst.encode(), None, BIND | REMOUNT | RDONLY | NOSUID | flags_of(src), None)

new = cfg["root"]
try:
    call("mount", None, b"/", None, REC | PRIVATE, None)
    call("mount", b"tmpfs", new.encode(), b"tmpfs", NOSUID | NODEV, b"size=1m,mode=755")
except OSError as e:
    if e.errno in REFUSED:
        unavailable(e)
    failed("mounting the new root at", new, e)
me = (1 if uid == 0 else 0) if userns else NOBODY  # the model's process's uid, in this user namespace
step, path = "", ""
try:
    step, path = "mounting the working directory at", new + "/work"
    os.makedirs(path)
    call("mount", b"tmpfs", path.encode(), b"tmpfs", NOSUID | NODEV, f"size={cfg['work_mb']}m".encode())
    os.chown(path, me, me)
    step, path = "binding the working directory at", new + "/tmp"
    os.makedirs(path)
    call("mount", (new + "/work").encode(), path.encode(), None, BIND, None)  # (a symlink would resolve on the host)
    for dev in ("null", "zero", "random", "urandom"):
        step, path = "binding", f"/dev/{dev}"
        bind(path, new, writable=True)
    for path in cfg["read_only"]:
        step = "binding read-only"
        if os.path.islink(path):
            os.makedirs(os.path.dirname(new + path), exist_ok=True)
            if not os.path.lexists(new + path):
                os.symlink(os.readlink(path), new + path)
        elif os.path.exists(path):
            bind(path, new)
    for path in cfg["hidden"]:  # e.g. site-packages under the standard library: an empty read-only tmpfs over it
        step = "hiding"
        if os.path.isdir(path):
            call("mount", b"tmpfs", (new + path).encode(), b"tmpfs", NOSUID | NODEV | RDONLY, b"size=4k")
    step, path = "entering the new root", new
    os.chdir(new)
    if libc.syscall({"x86_64": 155, "aarch64": 41}.get(os.uname().machine, -1), b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    call("umount2", b".", 2)  # MNT_DETACH: the old root is gone from this namespace
    os.chdir("/")
    call("mount", None, b"/", None, BIND | REMOUNT | RDONLY | NOSUID | NODEV, None)
except OSError as e:
    failed(step, path, e)

# 3. pid 1 of the new PID namespace: dies with this process; when it exits, the kernel kills every process left in
# the namespace (also those the model's code started in a new session).
r, w = os.pipe()
init = os.fork()
if init:
    os.close(w)
    _, status = os.waitpid(init, 0)
    reported = os.read(r, 64)
    status = int(reported) if reported else status
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
os.close(r)
call("prctl", 1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
child = os.fork()
if child:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:  # reap orphans until the model's process ends
        pid, status = os.wait()
        if pid == child:
            os.write(w, str(status).encode())
            os._exit(0)

# 4. the model's process: no privilege left, the limits, the audit hook, the code.
os.close(w)
for cap in range(64):
    libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (past the last capability: EINVAL, ignored)
libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
for which, value in (("CPU", cfg["cpu"]), ("AS", cfg["memory_mb"] << 20), ("FSIZE", cfg["fsize"]), ("CORE", 0),
                     ("NPROC", cfg["nproc"]), ("NOFILE", 256)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + which), (value, value))
if not userns:
    os.setgroups([])
os.setresgid(me, me, me)
os.setresuid(me, me, me)  # from root to nobody: every capability is cleared (not root outside: see capset)
header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
call("capset", header, data)  # no capability left in any set (header v3, two empty sets)
call("prctl", 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability can give them back
seccomp = "off"
if cfg["seccomp"]:  # the last layer, once nothing of the set-up needs a denied call (no_new_privs allows it unprivileged)
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]
    insns = (Insn * len(cfg["seccomp"]))(*[Insn(*i) for i in cfg["seccomp"]])
    try:
        call("prctl", 22, 2, ctypes.byref(Prog(len(insns), insns)), 0, 0)  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        seccomp = "on"
    except OSError as e:
        seccomp = f"refused by the kernel ({e})"
if cfg["probe"]:
    print(f"cleanrlhf-seccomp: {seccomp}", flush=True)
os.chdir("/work")
del libc, call
for name in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[name]
sys.dont_write_bytecode = True
if cfg["hook"]:
    _install_hook("/work", "/tmp")
del _install_hook
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
)


# The seccomp filter (namespaces mode), a classic-BPF program: the system calls a calculator-and-`math` program
# never needs fail with EPERM (the kernel's whole surface is otherwise open to the model's code). Where the numbers
# are not known (another architecture) no filter is installed, and check_sandbox says so in one line.
# x86_64's numbers (asm/unistd_64.h); the families: mounts and new roots, namespaces, tracing and other processes'
# memory, BPF and perf, the kernel keyring, io_uring, userfaultfd, kexec and modules, file handles, the clock,
# swap, reboot, accounting, quotas, raw I/O ports.
DENIED_X86_64 = {
    "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "unshare": 272, "setns": 308,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "bpf": 321, "perf_event_open": 298, "fanotify_init": 300,
    "keyctl": 250, "add_key": 248, "request_key": 249,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "userfaultfd": 323,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "name_to_handle_at": 303, "open_by_handle_at": 304,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "quotactl": 179, "quotactl_fd": 443,
    "iopl": 172, "ioperm": 173, "syslog": 103, "vhangup": 153, "uselib": 134, "lookup_dcookie": 212,
}  # fmt: skip
_X86_64 = dict(arch=0xC000003E, clone=56, clone3=435, socket=41)
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
AF_NETLINK, AF_PACKET, SOCK_RAW = 16, 17, 3


def seccomp_filter(machine: str | None = None) -> list[tuple[int, int, int, int]] | None:
    """The filter's instructions (code, jt, jf, k) for this machine (None where its numbers are not known). Denied:
    DENIED_X86_64 (EPERM); clone with a namespace flag (EPERM); clone3 (ENOSYS: its flags are behind a pointer the
    filter cannot read, and glibc then falls back to clone, as under Docker's profile); raw, netlink and packet
    sockets (EPERM); the x32 ABI and any other architecture's calls (the process is killed)."""
    if (machine or os.uname().machine) != "x86_64":
        return None
    LD, JEQ, JGE, JSET, AND, RET = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06  # BPF_LD|W|ABS, JMP|JEQ/JGE/JSET|K, ALU, RET
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    nr, arch, arg0, arg1 = 0, 4, 16, 24  # offsets in struct seccomp_data (the low word of each argument)
    a = _X86_64
    prog = [(LD, 0, 0, arch), (JEQ, 1, 0, a["arch"]), (RET, 0, 0, KILL), (LD, 0, 0, nr), (JGE, 0, 1, 0x40000000)]
    prog += [(RET, 0, 0, KILL)]
    for number in sorted(DENIED_X86_64.values()):
        prog += [(JEQ, 0, 1, number), (RET, 0, 0, EPERM)]
    prog += [(JEQ, 0, 1, a["clone3"]), (RET, 0, 0, ENOSYS)]
    prog += [(JEQ, 0, 4, a["clone"]), (LD, 0, 0, arg0), (JSET, 0, 1, CLONE_NAMESPACES), (RET, 0, 0, EPERM)]
    prog += [(RET, 0, 0, ALLOW)]
    prog += [(JEQ, 0, 6, a["socket"]), (LD, 0, 0, arg0), (JEQ, 5, 0, AF_NETLINK), (JEQ, 4, 0, AF_PACKET)]
    prog += [(LD, 0, 0, arg1), (AND, 0, 0, 0xF), (JEQ, 1, 0, SOCK_RAW), (RET, 0, 0, ALLOW), (RET, 0, 0, EPERM)]
    return prog  # (a jump's target is the next instruction + jt or jf)


class SandboxUnavailable(UserError):
    """The kernel refused the namespaces the Python tool needs."""


def _limits(timeout: float, memory_mb: int, max_file_bytes: int):
    """preexec_fn of the audit-mode child: its own process group (killed whole), CPU, address space, file size."""

    def apply():
        import resource

        cpu = max(1, int(timeout + 1))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


@functools.cache  # (every call needs it; it does not change within a process)
def _read_only_paths() -> tuple[list[str], list[str]]:
    """What the namespaces mode shows read-only: the standard library (and its extension modules) of the base
    interpreter (a venv's own lib folder holds only its site-packages), the interpreter's LIBDIR (the shared
    libraries a conda or shared-library build links its extension modules to), the system's lib folders and ld.so's
    cache; and what it hides inside them (site-packages). Real paths, wherever the interpreter lives."""
    base = dict(base=sys.base_prefix, platbase=sys.base_exec_prefix, installed_base=sys.base_prefix,
                installed_platbase=sys.base_exec_prefix)  # fmt: skip
    schemes = [sysconfig.get_paths(), sysconfig.get_paths(vars=base)]
    stdlib = {os.path.realpath(p[k]) for p in schemes[1:] for k in ("stdlib", "platstdlib")}
    # the extension modules' folder (lib-dynload), where the interpreter keeps it outside the stdlib folder
    dynload = {os.path.realpath(os.path.dirname(math.__file__))} if getattr(math, "__file__", None) else set()
    libdir = {os.path.realpath(d) for d in [sysconfig.get_config_var("LIBDIR")] if d and os.path.isdir(d)}
    system = ["/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache"]
    shown = sorted(p for p in stdlib | dynload | libdir if os.path.exists(p))
    shown = [p for p in shown if not any(p.startswith(q + os.sep) for q in shown)]  # a folder inside another: once
    hidden = {os.path.realpath(p[k]) for p in schemes for k in ("purelib", "platlib")}
    return shown + system, sorted(h for h in hidden if any(h.startswith(s + os.sep) for s in shown + system))


@functools.cache
def check_sandbox(sandbox: str, log=print) -> None:
    """Raise SandboxUnavailable (one line) now, at start-up, where `sandbox` cannot run; once per process. Where the
    seccomp layer cannot be installed (another architecture, a kernel without it), `log` says so in one line."""
    out, ok = run_python("print('ok')", sandbox=sandbox, _probe=sandbox == "namespaces")
    lines = out.splitlines()
    if sandbox == "namespaces" and lines and lines[0].startswith("cleanrlhf-seccomp:"):
        state = lines.pop(0).split(":", 1)[1].strip()
        if state != "on":
            why = f"no filter for {os.uname().machine}" if state == "off" else state
            log(f"the Python tool's seccomp layer is not installed ({why}): the namespaces and limits still hold")
    if not ok or lines != ["ok"]:
        last = lines[-1] if lines else "no output"
        raise UserError(f"--tool-sandbox {sandbox}: the Python tool does not run here: {last}")


def _wait(child: subprocess.Popen, code: bytes, timeout: float) -> None:
    """Give the child its code and wait for its end, up to `timeout` (subprocess.TimeoutExpired). Popen.wait(timeout)
    polls with sleeps of up to 50 ms (most of a short call's time); a pidfd is readable the moment the child exits."""
    try:
        child.stdin.write(code)  # (the child reads its code first)
        child.stdin.close()
    except BrokenPipeError:
        pass
    try:
        fd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the polling wait
        child.wait(timeout)
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(child.args, timeout)
    finally:
        os.close(fd)
    child.wait()


def run_python(
    code: str,
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_chars: int = 1000,
    sandbox: str = "namespaces",
    work_mb: int = 64,
    nproc: int = 32,
    _hook: bool = True,
    _userns: bool = False,
    _seccomp: bool = True,
    _probe: bool = False,
) -> tuple[str, bool]:
    """Run `code` in a limited child process (module docstring) under `sandbox` (namespaces | audit). Returns (its
    output: stdout and stderr, cut to `max_chars`, or what stopped it; ok: it exited 0 within its limits). Raises
    SandboxUnavailable (one line naming --tool-sandbox) where the kernel refuses the namespaces. `_hook=False` leaves
    the audit hook out and `_userns=True` takes the user-namespace path as root too (tests: the OS layer alone must
    hold, on either path)."""
    if sandbox not in SANDBOXES:
        raise UserError(f"--tool-sandbox {sandbox}: expected one of {', '.join(SANDBOXES)}")
    fsize = max(4 * max_chars, 1 << 16)
    workdir = tempfile.mkdtemp(prefix="cleanrlhf_tool_")  # audit: the child's cwd; namespaces: its root's mount point
    if sandbox == "namespaces":
        read_only, hidden = _read_only_paths()
        cfg = dict(root=workdir, read_only=read_only, hidden=hidden, work_mb=work_mb, nproc=nproc, hook=_hook,
                   cpu=max(1, int(timeout + 1)), memory_mb=memory_mb, fsize=fsize, userns=_userns, extra=_UNSHARE_EXTRA,
                   seccomp=seccomp_filter() if _seccomp else None, probe=_probe)  # fmt: skip
        argv, preexec = [sys.executable, "-I", "-S", "-c", _NS_MAIN, json.dumps(cfg)], None
    else:
        argv, preexec = (
            [sys.executable, "-I", "-S", "-c", _AUDIT_MAIN, str(int(_hook))],
            _limits(timeout, memory_mb, fsize),
        )
    ok, note = False, ""
    try:
        with tempfile.TemporaryFile() as out:  # outside the child's view; capped by RLIMIT_FSIZE
            # -I: isolated (no PYTHON* variables, no user site, no script dir on sys.path); -S: no site module
            child = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env={},  # nothing of the trainer's environment
                preexec_fn=preexec,
                start_new_session=True,  # its own process group: killed whole on timeout
                close_fds=True,
            )
            t0 = time.monotonic()
            try:
                _wait(child, code.encode(), timeout)
                ok = child.returncode == 0
                if child.returncode < 0:
                    note = f"[killed by signal {signal.Signals(-child.returncode).name}]"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)  # (namespaces: pid 1 dies with it, and the whole namespace)
                child.wait()
                note = f"[timed out after {time.monotonic() - t0:.1f} s]"
            out.seek(0)
            text = out.read(max_chars + 1).decode(errors="replace")
        if child.returncode == _UNAVAILABLE and text.startswith("cleanrlhf-sandbox-unavailable:"):
            raise SandboxUnavailable(
                f"the Python tool's sandbox needs Linux namespaces (user or root, mount, pid, net), which this machine "
                f"refuses ({text.split(':', 1)[1].strip()}): run where they are allowed, or pass --tool-sandbox audit "
                "for the weaker audit-hook-only mode (docs/agents.md)"
            )
        if child.returncode == _FAILED and text.startswith("cleanrlhf-sandbox-failed:"):
            raise SandboxUnavailable(
                f"the Python tool's sandbox could not be built: {text.split(':', 1)[1].strip()} (the kernel allows the "
                "namespaces; this is a fault of the sandbox's layout on this machine: please report it with this line)"
            )
        if len(text) > max_chars:
            text = text[:max_chars] + "\n[output truncated]"
        return (text + ("\n" if text and note else "") + note).strip(), ok
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
