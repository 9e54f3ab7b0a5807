"""The Python tool as an OS-level boundary (common/integrations/sandbox.py, namespaces mode): each escape found by
trying the tool as an attacker would, with the standard library only, fails to get out. Every probe runs with the audit
hook on (the default) and off (the OS layer alone must hold: the hook is Python-level and was switched off from inside
before), and on both of the sandbox's paths: as root (the model's process becomes nobody) and through a user namespace
(the path a non-root trainer takes)."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.integrations import sandbox
from common.integrations.sandbox import SandboxUnavailable, run_python
from shared_sandbox import _accept

REPO = Path(__file__).resolve().parents[2]

LAYERS = [
    pytest.param(dict(), id="hook+os"),
    pytest.param(dict(_hook=False), id="os-only"),
    pytest.param(dict(_hook=False, _userns=True), id="os-only-userns"),
]

POSIXSUBPROCESS = next(Path(os.__file__).parent.glob("lib-dynload/_posixsubprocess*.so"))


@pytest.fixture
def trainer_with_a_secret():
    """A process started with a token in its environment (as a trainer started with WANDB_API_KEY set): its pid."""
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, "WANDB_API_KEY": "wandb_secret_value"})
    for _ in range(200):  # until its exec has happened (its environ is the new one)
        if b"wandb_secret_value" in Path(f"/proc/{proc.pid}/environ").read_bytes():
            break
        time.sleep(0.01)
    yield proc.pid
    proc.kill()
    proc.wait()


def tool(code, **kw):
    out, ok = run_python(code, timeout=kw.pop("timeout", 5.0), **kw)
    return out


def _renamed_fork_exec(shell_command):
    """Tool code that loads the standard library's _posixsubprocess under another name (no audit event: the hook's
    import rule does not see it) and starts a shell, /usr/bin/sh, or the interpreter itself through it."""
    return (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('pkg._posixsubprocess', {str(POSIXSUBPROCESS)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"for exe in ('/bin/sh', '/usr/bin/sh', {sys.executable!r}):\n"
        "    r, w = os.pipe()\n"  # the exec's error comes back on this pipe (as subprocess reads it)
        f"    pid = m.fork_exec([exe, '-c', {shell_command!r}], [exe.encode()], True, (w,), None, None, -1, -1, -1,"
        " -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, True)\n"
        "    os.close(w); err = os.read(r, 100); os.waitpid(pid, 0)\n"
        "    print('refused' if err else 'started', exe, err.decode()[:11])"
    )


@pytest.fixture
def sandbox_processes(monkeypatch, request):
    """This test's tool processes, as host pids: their command line names the sandbox's mount point, which gets a
    prefix of this test's own here (under xdist the other worker's calls are not this test's)."""
    tag = f"cleanrlhf_tool_{os.getpid()}_{abs(hash(request.node.nodeid))}_"
    real = sandbox.tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda prefix=None, **kw: real(prefix=tag, **kw))

    def scan() -> set[int]:
        found = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if tag.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(int(pid))
            except OSError:
                pass
        return found

    return scan


# ---------------------------------------------------------------------------------------------
# wherever Python lives: a venv under /tmp or under a path holding "work", an interpreter whose standard library is
# under /tmp (the sandbox's own layout is /work, /tmp and /dev: no bind may collide with it)
# ---------------------------------------------------------------------------------------------
PROBE = (
    "import sys; sys.path.insert(0, {repo!r})\n"
    "from common.integrations.sandbox import run_python\n"
    "print(sys.prefix)\n"
    "print(repr(run_python('import math, decimal, os; print(math.lcm(16, 18), decimal.Decimal(1) / 4, "
    'sorted(os.listdir("/tmp")) == sorted(os.listdir("/work")))\')))\n'
)


def _tool_from(python):
    """The tool's answer when the trainer runs on `python` (common/integrations/sandbox.py needs the standard library
    only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([str(python), "-c", PROBE.format(repo=str(REPO))], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    prefix, answer = out.stdout.strip().splitlines()
    assert prefix == str(Path(python).parents[1]), prefix  # the trainer ran on that interpreter (its venv applied)
    return answer


# ---------------------------------------------------------------------------------------------
# the seccomp layer
# ---------------------------------------------------------------------------------------------
def _run_bpf(prog, nr, arch=0xC000003E, args=(0,) * 6):
    """Classic BPF as the kernel runs a seccomp filter (only the instructions a filter of ours may hold), on one
    struct seccomp_data: nr, arch, the arguments' low words."""
    data = {0: nr, 4: arch, **{16 + 8 * i: a & 0xFFFFFFFF for i, a in enumerate(args)}}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == 0x20:
            acc = data[k]
        elif code == 0x54:
            acc &= k
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"instruction {code:#x} is not one a filter of ours holds")
        pc += 1


SYSCALLS = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, nr, *a):
    r = libc.syscall(nr, *a)
    print(name, 'ok' if r >= 0 else errno.errorcode.get(ctypes.get_errno()), flush=True)
sc('unshare', 272, 0x10000000 | 0x20000)  # a nested user and mount namespace ...
sc('mount', 165, b'none', b'/work', b'tmpfs', 0, None)  # ... in which a mount would be allowed
sc('setns', 308, -1, 0)
sc('clone_newuser', 56, 0x10000000 | 17, 0, 0, 0, 0)
sc('ptrace', 101, 0, 0, 0, 0)
sc('bpf', 321, 0, None, 0)
sc('perf_event_open', 298, None, 0, -1, -1, 0)
sc('keyctl', 250, 0, 0)
sc('io_uring_setup', 425, 1, None)
sc('userfaultfd', 323, 0)
sc('kexec_load', 246, 0, 0, None, 0)
sc('finit_module', 313, -1, b'', 0)
for name, (domain, kind) in dict(netlink=(16, 3), packet=(17, 3), raw=(2, 3)).items():
    try:
        socket.socket(domain, kind, 0); print(name, 'ok')
    except OSError as e:
        print(name, errno.errorcode[e.errno])
"""


def test_the_default_mode_is_namespaces_and_ordinary_programs_run():
    out, ok = run_python(
        "import os, math, fractions, itertools, decimal, statistics, random, json, re, collections, hashlib, tempfile\n"
        "print(math.gcd(12, 18), fractions.Fraction(1, 3) + 1, list(itertools.permutations('ab')), os.getcwd())\n"
        "open('a.txt', 'w').write('x'); print(os.listdir('.'), tempfile.gettempdir(), sorted(os.listdir('/')))"
    )
    assert ok, out
    first, second = out.splitlines()
    assert first == "6 4/3 [('a', 'b'), ('b', 'a')] /work"
    assert second.startswith("['a.txt'] /tmp"), second
    assert "proc" not in second and "home" not in second and "bin" not in second  # only what the tool needs
    out, ok = run_python("import os; print(os.listdir('.'))")  # a fresh working directory per call
    assert ok and out == "[]"


@pytest.mark.parametrize("kw", LAYERS)
def test_no_secret_through_proc_and_no_file_of_the_trainer(kw, tmp_path, trainer_with_a_secret):
    assert b"wandb_secret_value" in Path(f"/proc/{trainer_with_a_secret}/environ").read_bytes()  # there to be read
    secret = tmp_path / "token.txt"
    secret.write_text("hf_secret_value")
    for path in (f"/proc/{trainer_with_a_secret}/environ", f"/proc/{os.getpid()}/environ", "/proc/self/environ", f"/proc/{os.getppid()}/environ", secret,
                 REPO / "common/__init__.py", Path.home() / ".bashrc", "/etc/passwd"):  # fmt: skip
        out = tool(f"print(open({str(path)!r}).read())", **kw)
        assert "secret_value" not in out and ("FileNotFoundError" in out or "Permission" in out), (path, out)
    out = tool(
        "import os; print(os.listdir('/'), os.listdir('/proc') if os.path.exists('/proc') else 'no /proc')", **kw
    )
    assert "no /proc" in out and "work" in out


@pytest.mark.parametrize("kw", LAYERS)
def test_no_write_outside_by_any_route(kw, tmp_path):
    """Writes the audit hook alone let through: after os.chdir, through dir_fd, mkfifo, setxattr, into /dev/shm and
    /proc/<ppid>; and plain absolute paths. Nothing appears or changes outside."""
    target, project = tmp_path / "outside.txt", REPO / "common/__init__.py"
    before = project.read_bytes()
    shm = f"/dev/shm/cleanrlhf_probe_{os.getpid()}"
    probes = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os; os.chdir({str(REPO)!r}); open('common/__init__.py', 'a').write('import os')",
        f"import os; os.chdir({str(tmp_path)!r}); open('outside.txt', 'w').write('x')",
        f"import os; fd = os.open({str(tmp_path)!r}, os.O_RDONLY); os.open('outside.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        f"import os; os.mkfifo({str(target)!r})",
        f"import os; os.setxattr({str(project)!r}, 'user.x', b'1')",
        f"open({shm!r}, 'w').write('x')",
        "import os; open('/proc/' + str(os.getppid()) + '/oom_score_adj', 'w').write('1000')",
        f"open('/proc/{os.getpid()}/oom_score_adj', 'w').write('1000')",
        "open('/usr/lib/cleanrlhf_probe', 'w').write('x')",
        "open('/cleanrlhf_probe', 'w').write('x')",
    ]  # fmt: skip
    for code in probes:
        out = tool(code, **kw)
        assert "Error" in out or "sandbox" in out, (code, out)
    assert not target.exists() and project.read_bytes() == before and not os.path.exists(shm)
    assert not Path("/usr/lib/cleanrlhf_probe").exists() and not Path("/cleanrlhf_probe").exists()
    assert open(f"/proc/{os.getpid()}/oom_score_adj").read().strip() != "1000"


@pytest.mark.parametrize("kw", LAYERS)
def test_no_process_gets_out_or_outlives_the_call(kw, tmp_path, sandbox_processes):
    """A process started through a renamed _posixsubprocess (no audit event), one left behind in a new session, a
    fork bomb: none writes outside, none is left after the call, the bomb stops at RLIMIT_NPROC."""
    before = sandbox_processes()
    target = tmp_path / "by_shell.txt"
    out = tool(_renamed_fork_exec(f"echo x > {target}"), **kw)
    assert out.count("refused") == out.count("OSError:2:") == 3 and "started" not in out, (
        out
    )  # ENOENT: no binary to run in its view
    time.sleep(0.5)
    assert not target.exists()
    if kw.get("_hook", True) is False:  # os.fork itself is refused by the hook; the OS layer must hold without it
        out = tool("import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\nprint('parent exits')", **kw)
        assert "parent exits" in out
        out = tool(
            "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "            os._exit(0)\n        n += 1\nexcept OSError as e:\n    print('stopped after', n, e.errno)",
            timeout=10.0,
            **kw,
        )
        assert out.startswith("stopped after") and int(out.split()[2]) <= 32, out
    time.sleep(0.5)
    assert sandbox_processes() <= before  # every process of the call died with its PID namespace


@pytest.mark.parametrize("kw", LAYERS)
def test_the_trainer_cannot_be_signalled_or_limited(kw):
    me = os.getpid()
    soft = __import__("resource").getrlimit(__import__("resource").RLIMIT_FSIZE)
    for code in (
        f"import os, signal; signal.pidfd_send_signal(os.pidfd_open({me}), signal.SIGKILL)",
        f"import os, signal; os.kill({me}, signal.SIGKILL)",
        f"import resource; resource.prlimit({me}, resource.RLIMIT_FSIZE, (0, 0))",
        "import os, signal; os.kill(os.getppid(), signal.SIGKILL); print('ppid', os.getppid())",
    ):
        tool(code, **kw)
    assert __import__("resource").getrlimit(__import__("resource").RLIMIT_FSIZE) == soft  # (and we are alive)


def test_the_hook_cannot_be_switched_off_from_inside():
    out = tool(
        "import sys\nm = sys.modules['__main__']\ncleared = 0\n"
        "for name in dir(m):\n    v = getattr(m, name)\n    if isinstance(v, (set, dict, list)) and name != '__builtins__':\n"
        "        v.clear(); cleared += 1\n"
        "print('cleared', cleared)\nimport socket"
    )
    assert "cleared" in out and "sandbox: import of socket is not allowed" in out, out


@pytest.mark.parametrize("kw", LAYERS[1:])  # with the hook, the socket module cannot even be imported
def test_no_socket_reaches_a_server_on_the_host(kw):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)))
    thread.start()
    port = server.getsockname()[1]
    out = tool(
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')", **kw
    )
    server.shutdown(socket.SHUT_RDWR)  # (wakes the accept still waiting)
    server.close()
    thread.join()
    assert "connected" not in out and accepted == [None], out


@pytest.mark.parametrize("kw", LAYERS)
def test_a_disk_filler_fills_only_its_own_size_limited_directory(kw):
    out = tool(
        "import os\nn = 0\ntry:\n    while True:\n        with open(f'f{n}', 'wb') as f:\n            f.write(b'x' * 60000)\n"
        "        n += 1\nexcept OSError as e:\n    print('stopped after', n, e.errno)",
        work_mb=4,
        **kw,
    )
    assert out.startswith("stopped after") and out.split()[-1] == "28", out  # ENOSPC at ~4 MiB
    assert 50 <= int(out.split()[2]) <= 80


def test_where_namespaces_are_refused_the_tool_names_the_weaker_mode(monkeypatch):
    monkeypatch.setattr(sandbox, "_UNSHARE_EXTRA", 0x1)  # an invalid unshare flag: the kernel refuses (EINVAL)
    with pytest.raises(SandboxUnavailable, match="--tool-sandbox audit") as e:
        run_python("print(1)")
    assert "\n" not in str(e.value)
    out, ok = run_python("print(1)", sandbox="audit")  # the weaker mode, asked for
    assert ok and out == "1"


def test_a_killed_call_takes_its_whole_namespace_with_it(sandbox_processes):
    before = sandbox_processes()
    out, ok = run_python("import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(30)", timeout=1.0, _hook=False)
    assert not ok and "timed out" in out
    time.sleep(0.5)
    assert sandbox_processes() <= before  # SIGKILL to its process group; pid 1's death ended the rest


@pytest.mark.parametrize("kw", LAYERS)
def test_no_privilege_is_left(kw):
    out = tool(
        "import os\nfor name, call in (('chroot', lambda: os.chroot('.')), ('setuid', lambda: os.setuid(0)),"
        " ('chown', lambda: os.chown('/work', 0, 0)), ('sethostname', lambda: __import__('socket').sethostname('x'))):\n"
        "    try:\n        call(); print(name, 'allowed')\n    except Exception as e:\n        print(name, 'refused')",
        **kw,
    )
    assert "allowed" not in out and out.count("refused") == 4, out


def test_the_audit_mode_is_weaker_as_documented(tmp_path, trainer_with_a_secret):
    """--tool-sandbox audit is what docs/agents.md says: the hook's refusals hold, the escapes above do not."""
    out, ok = run_python("import socket", sandbox="audit")
    assert not ok and "sandbox: import of socket" in out
    out, ok = run_python(
        f"print(open('/proc/{trainer_with_a_secret}/environ').read())", sandbox="audit", max_chars=10**5
    )
    assert ok and "wandb_secret_value" in out  # readable: not a boundary
    out, ok = run_python(f"import os; os.chdir({str(tmp_path)!r}); open('x.txt', 'w').write('1')", sandbox="audit")
    assert ok and (tmp_path / "x.txt").exists()  # the chdir route past the hook
    out, ok = run_python(_renamed_fork_exec(f"echo x > {tmp_path / 'by_shell.txt'}"), sandbox="audit")
    time.sleep(0.5)
    assert "started /bin/sh" in out and (tmp_path / "by_shell.txt").exists()  # a process past the hook


def test_a_tool_environment_refuses_at_start_up_and_takes_the_flag(monkeypatch, tiny):
    """From the flags a user has: --env tools with the Python tool checks the sandbox when the environment is built
    (one line naming --tool-sandbox where namespaces are refused); --tool-sandbox audit reaches the tool."""
    from transformers import AutoTokenizer

    from common.harness.args import EnvArgs
    from common.integrations.builtin_envs import ToolEnv
    from common.integrations.inputs import episodes_from_args

    monkeypatch.setattr(sandbox, "_UNSHARE_EXTRA", 0x1)
    sandbox.check_sandbox.cache_clear()
    with pytest.raises(SandboxUnavailable, match="--tool-sandbox audit"):
        ToolEnv(("calculator", "python"))
    ToolEnv(("calculator",))  # no Python tool, no check
    env = ToolEnv(("python",), sandbox="audit")
    assert env.run_tool({"name": "python", "arguments": {"code": "import os; print(os.getcwd() != '/work')"}}) == (
        "True",
        True,
    )
    monkeypatch.setattr(sandbox, "_UNSHARE_EXTRA", 0)
    sandbox.check_sandbox.cache_clear()
    tok = AutoTokenizer.from_pretrained(tiny)
    episodes = episodes_from_args(EnvArgs(env="tools", tools="python", tool_sandbox="audit"), tok, None, "cpu")
    assert episodes.factory().sandbox == "audit"
    assert EnvArgs().tool_sandbox == "namespaces"


@pytest.mark.bare
@pytest.mark.parametrize("where", ["scratch", "work", "work/tmp/dev"])
def test_the_tool_runs_from_a_venv_wherever_it_lives(where, tmp_path):
    """A venv under /tmp (a job's scratch; before, the new root's /tmp collided with the venv's folder), and under
    folders named like the sandbox's own layout (work, tmp, dev), each runs the default mode."""
    import venv

    assert str(tmp_path).startswith("/tmp/")
    path = tmp_path / where / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    assert _tool_from(path / "bin" / "python") == "('144 0.25 True', True)"


@pytest.mark.bare
def test_the_tool_runs_on_an_interpreter_installed_under_tmp(tmp_path):
    """An interpreter whose standard library itself lives under /tmp (a conda or standalone build unpacked into a job's
    scratch): its folders are bound inside the sandbox's /tmp (and /work: one tmpfs), read-only, and the tool runs."""
    import shutil
    import sysconfig

    base = Path(sys.base_prefix).resolve()
    prefix = tmp_path / "py"

    def link(src, dst):
        try:
            os.link(src, dst)  # a copy of the standard library without its bytes (same filesystem)
        except OSError:
            shutil.copy2(src, dst)

    skip = shutil.ignore_patterns("site-packages", "test", "idlelib", "tkinter", "ensurepip", "__pycache__")
    shutil.copytree(base / "bin", prefix / "bin", symlinks=True, copy_function=link)
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": str(base), "base": str(base)})["stdlib"]).resolve()
    shutil.copytree(stdlib, prefix / stdlib.relative_to(base), ignore=skip, copy_function=link)
    for lib in base.glob("lib/libpython*"):
        link(lib, prefix / "lib" / lib.name)
    python = prefix / "bin" / Path(sys.executable).name
    out = subprocess.run([str(python), "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    assert out.stdout.strip() == str(prefix), out  # the copy is its own installation, under /tmp
    assert _tool_from(python) == "('144 0.25 True', True)"


def test_a_fault_of_the_layout_names_its_step_and_path_not_the_weaker_mode(monkeypatch):
    """Only a kernel refusal suggests --tool-sandbox audit; a step that fails on a path says which (here: hiding a
    folder that has no place in the new root)."""
    read_only, hidden = sandbox._read_only_paths()
    monkeypatch.setattr(sandbox, "_read_only_paths", lambda: (read_only, [*hidden, "/srv"]))
    assert os.path.isdir("/srv")
    with pytest.raises(SandboxUnavailable) as e:
        run_python("print(1)")
    message = str(e.value)
    assert "hiding /srv" in message and "No such file" in message and "audit" not in message, message
    assert "\n" not in message


def test_the_seccomp_program_decides_as_specified():
    """Each decision of the filter, read off an interpreter of its instructions, against the specification."""
    prog = sandbox.seccomp_filter("x86_64")
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x50001, 0x50026
    assert len(prog) < 4096 and sandbox.seccomp_filter("aarch64") is None
    for name, nr in sandbox.DENIED_X86_64.items():
        assert _run_bpf(prog, nr) == EPERM, name
    for nr in (0, 1, 2, 3, 9, 12, 39, 57, 59, 60, 231, 257, 262, 318, 332, 434):  # read ... pidfd_open
        assert _run_bpf(prog, nr) == ALLOW, nr
    assert _run_bpf(prog, 435) == ENOSYS  # clone3
    thread_flags = 0x003D0F00  # CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID
    assert _run_bpf(prog, 56, args=(thread_flags,)) == ALLOW and _run_bpf(prog, 56, args=(17,)) == ALLOW
    for flag in (0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000):
        assert _run_bpf(prog, 56, args=(17 | flag,)) == EPERM, hex(flag)
    for domain, kind, verdict in [(2, 1, ALLOW), (2, 2, ALLOW), (1, 1, ALLOW), (10, 1 | 0x80000, ALLOW),
                                  (2, 3, EPERM), (10, 3 | 0x800, EPERM), (16, 3, EPERM), (16, 2, EPERM),
                                  (17, 3, EPERM), (17, 2, EPERM)]:  # fmt: skip
        assert _run_bpf(prog, 41, args=(domain, kind)) == verdict, (domain, kind)
    assert _run_bpf(prog, 0x40000000 + 0) == KILL  # the x32 ABI's read
    assert _run_bpf(prog, 0, arch=0x40000003) == KILL  # i386's calls (int 0x80) from a 64-bit process


@pytest.mark.parametrize("kw", LAYERS[1:])  # the hook refuses ctypes and socket: the filter must hold without it
def test_seccomp_denies_each_family(kw):
    """With the filter every family is refused with EPERM; without it (the same namespaces, no privilege) a nested
    user namespace, ptrace, netlink sockets and the rest get through to the kernel: the filter is what stops them."""
    on = dict(line.split() for line in tool(SYSCALLS, **kw).splitlines())
    off = dict(line.split() for line in tool(SYSCALLS, _seccomp=False, **kw).splitlines())
    assert len(on) == len(off) == 15, (on, off)
    assert set(on.values()) == {"EPERM"}, on
    assert off["unshare"] == "ok" and off["mount"] == "ok", off  # what the filter closes: a nested root of its own
    assert off["ptrace"] == "ok" and off["netlink"] == "ok", off
    differ = sorted(k for k in on if off[k] != "EPERM")
    assert len(differ) >= 11, (differ, off)  # the rest fail for want of privilege either way (packet, userfaultfd)


def test_ordinary_programs_keep_threads_and_forks_under_the_filter():
    code = (
        "import os, threading, concurrent.futures as cf\nt = threading.Thread(target=print, args=('thread',))\n"
        "t.start(); t.join()\nwith cf.ThreadPoolExecutor(4) as ex: print(sum(ex.map(abs, range(-5, 5))))\n"
        "pid = os.fork()\nif pid == 0: os._exit(3)\nprint('fork', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    )
    out, ok = run_python(code, _hook=False)
    assert ok and out.splitlines() == ["thread", "25", "fork 3"], out


def test_where_the_filter_cannot_be_installed_a_line_says_so(monkeypatch):
    lines = []
    sandbox.check_sandbox.cache_clear()
    try:
        sandbox.check_sandbox("namespaces", log=lines.append)
        assert lines == []  # installed here
        monkeypatch.setattr(sandbox, "seccomp_filter", lambda: None)  # (another architecture)
        sandbox.check_sandbox.cache_clear()
        sandbox.check_sandbox("namespaces", log=lines.append)
        assert len(lines) == 1 and "seccomp layer is not installed (no filter for" in lines[0], lines
    finally:
        sandbox.check_sandbox.cache_clear()


@pytest.mark.parametrize("kw", LAYERS)
def test_no_descriptor_of_the_trainer_is_inherited(kw, tmp_path):
    """A file the trainer holds open without close-on-exec (a checkpoint being written, a log) is not among the
    tool's descriptors: it has its stdin (its code, read), its output file and nothing else."""
    secret = tmp_path / "held_open.txt"
    secret.write_text("trainer_secret_value")
    fd = os.open(secret, os.O_RDWR)
    os.set_inheritable(fd, True)
    try:
        out = tool("import os\nfor fd in range(256):\n    try:\n        os.fstat(fd); print(fd)\n    except OSError:\n"
                   "        pass\nprint('done')", **kw)  # fmt: skip
    finally:
        os.close(fd)
    assert out.split() == ["0", "1", "2", "done"], out
    assert secret.read_text() == "trainer_secret_value"


@pytest.mark.parametrize("kw", LAYERS[1:])
def test_shared_memory_and_memfd_cannot_fill_the_machine(kw):
    """No /dev/shm exists in its view; a memfd (memory the tool's tmpfs does not count) is capped by RLIMIT_FSIZE,
    so writing 200 MB into one stops at the output file's cap."""
    out = tool(
        "import os\ntry:\n    open('/dev/shm/x', 'w')\nexcept OSError as e:\n    print('shm', e.errno)\n"
        "fd = os.memfd_create('filler')\nn = 0\ntry:\n    for _ in range(200):\n        n += os.write(fd, b'x' * 2**20)\n"
        "except OSError as e:\n    print('memfd stopped at', n, e.errno)",
        **kw,
    )
    lines = out.splitlines()
    assert lines[0] == "shm 2", out  # ENOENT: the path does not exist
    assert lines[1].startswith("memfd stopped at") and lines[1].endswith(" 27"), out  # EFBIG
    assert int(lines[1].split()[3]) <= 1 << 20, out
