"""A warm start for the scripts the tests launch (conftest.run_script): one process imports torch, transformers,
accelerate and common/ once (~5.6 s on this machine's 2 cores), then forks a child per launch that runs
`python algos/X.py flags` as the interpreter would: the script as __main__ with that argv, the launch's
environment and working directory, stdin from /dev/null, stdout and stderr into files, its atexit functions and
non-daemon threads finished, its exit code (or -signal). Tools (`python -m tools.X` from the repository) run the same
way. A CI run launches ~150: the imports were ~14 minutes of its CPU.

What a child does not see, and so where run_script starts a fresh process instead (`serves`):
- an environment variable that differs from the zygote's and may be read at import time (IMPORT_TIME_PREFIXES);
- the start-up output of the imports (a library's import-time warning is printed once, by the zygote): the smoke
  runs, which check that a script starts quietly, always start fresh.

The server runs one thread (fork from a threaded process is unsafe): a select loop that accepts a request, forks,
answers the child's pid, and reaps children (their exit codes to their requests). It ends with its parent."""

import json
import os
import select
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Variables the zygote's imports (torch, transformers, accelerate, huggingface_hub, tokenizers, numpy, common/) may
# read: a launch whose environment differs from the zygote's in one of these starts fresh. Any other difference
# (TOY_MODEL, the running test's name, what an in-process test set: DS_ACCELERATOR, VLLM_*) is read only once a
# script runs, after the child has taken the launch's environment.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA",
                        "NCCL", "PYTHON", "LD_", "TOKENIZERS", "XDG_", "HOME", "TMPDIR", "SAFETENSORS", "DATASETS",
                        "NUMEXPR", "OPENBLAS", "CLEANRLHF_CACHE")  # fmt: skip
# What torchrun's agent sets for each rank (torch.distributed.elastic's local agent), read when a process group is
# made, not at import: a rank of a launch (run_ranks) may differ from the zygote in these.
ELASTIC = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
           "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
           "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_SIGNALS_TO_HANDLE")  # fmt: skip


def _child(req: dict) -> None:
    """In the forked child: become `python <argv>` and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, as a fresh launch from the test would not share the zygote's
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
            f = os.open(path, flags, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import runpy

        argv = req["argv"]
        try:
            if argv[1] == "-m":  # `python -m tools.X flags`: the working directory first on the path
                sys.argv, sys.path[:] = [argv[2], *argv[3:]], [req["cwd"], *_PATH[1:]]
                runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            else:  # `python algos/X.py flags`: the script's folder first
                sys.argv, sys.path[:] = argv[1:], [str(Path(argv[1]).parent), *_PATH[1:]]
                runpy.run_path(argv[1], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        threading._shutdown()  # as the interpreter's exit: wait for the non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110  # a closed stream: nothing left to write
                pass
        os._exit(code)


_PATH = list(
    sys.path
)  # this process's path before REPO is added: [tests/helpers/, the standard library, site-packages]


def serve(path: str) -> None:
    sys.path.insert(0, str(REPO))
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import tyro  # noqa: F401

    import common.core.sampling  # noqa: F401
    import common.harness.cli  # noqa: F401
    import common.harness.eval  # noqa: F401
    import common.harness.run  # noqa: F401
    import common.integrations.async_generator  # noqa: F401

    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    waiting = {}  # pid -> the connection its exit code goes to
    while os.getppid() == parent:
        ready, _, _ = select.select([server], [], [], 0.2)
        if ready:
            conn, _ = server.accept()
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            pid = os.fork()
            if pid == 0:
                server.close()
                _child(json.loads(data))
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:  # the test went away: its child still runs to its end
                pass
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the test stopped waiting (its timeout killed the child)
                    pass
                conn.close()


def import_env(env: dict) -> tuple:
    """The part of an environment the zygote's imports may read: launches that agree on it share a zygote."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)))


class Zygote:
    """The client side, in the test process: one per import-time environment (`import_env`), run() per launch."""

    def __init__(self, workdir: Path, env: dict | None = None):
        import subprocess

        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = str(self.dir / "zygote.sock")
        self.env = dict(env if env is not None else os.environ)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdout=subprocess.PIPE, text=True,
                                     env=self.env)  # fmt: skip
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the test zygote did not start: {line!r}")
        self.n = 0

    def serves(self, argv: list[str], env: dict, cwd: Path) -> bool:
        """True if a child of the zygote runs `argv` with `env` as a fresh process would (see the module's doc): a
        script of REPO/algos, or `-m tools.X` from REPO."""
        ours = argv[1:2] == ["-m"] and argv[2].startswith("tools.") and Path(cwd).resolve() == REPO
        ours = ours or (argv[1] != "-m" and Path(argv[1]).resolve().parent == REPO / "algos")
        if self.proc.poll() is not None or not ours:
            return False
        differ = {k for k in set(env) | set(self.env) if env.get(k) != self.env.get(k)} - set(ELASTIC)
        return not any(k.startswith(IMPORT_TIME_PREFIXES) for k in differ)

    def run(self, argv: list[str], env: dict, timeout: float, cwd: Path):
        """`argv` run by a child: a subprocess.CompletedProcess; subprocess.TimeoutExpired after `timeout` s (the
        child killed, as subprocess.run does)."""
        return self.run_ranks(argv, [env], timeout, cwd)

    def run_ranks(self, argv: list[str], envs: list[dict], timeout: float, cwd: Path):
        """`argv` run by one child per environment at once (the ranks of a launch: conftest.launch_ranks), as
        torchrun's agent runs them: when one fails, the others get SIGTERM, then SIGKILL 10 s later. A
        CompletedProcess whose output is every child's in rank order, its code the first failure's (0 if none)."""
        import signal
        import subprocess
        import time

        children = []
        for env in envs:
            self.n += 1
            out, err = self.dir / f"{self.n}.out", self.dir / f"{self.n}.err"
            req = dict(argv=argv, env=env, cwd=str(cwd), stdout=str(out), stderr=str(err))
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.path)
            conn.sendall(json.dumps(req).encode() + b"\n")
            c = dict(conn=conn, buf=b"", out=out, err=err, code=None)
            while b"\n" not in c["buf"]:  # its pid (unbuffered reads: the code line may follow in the same recv)
                c["buf"] += conn.recv(64) or b"-9\n"
            line, c["buf"] = c["buf"].split(b"\n", 1)
            children.append(c | dict(pid=int(line)))

        def kill(sig):
            for c in children:
                if c["code"] is None:
                    try:
                        os.killpg(c["pid"], sig)
                    except ProcessLookupError:
                        pass

        deadline, stop_at, first = time.monotonic() + timeout, None, 0  # first: the first failure's exit code
        while any(c["code"] is None for c in children):
            pending = [c for c in children if c["code"] is None]
            ready, _, _ = select.select([c["conn"] for c in pending if b"\n" not in c["buf"]], [], [], 0.5)
            for c in pending:
                if c["conn"] in ready:
                    c["buf"] += c["conn"].recv(64) or b"-9\n"  # a closed socket: the zygote died
                if b"\n" in c["buf"]:
                    c["code"] = int(c["buf"].split(b"\n", 1)[0])
                    first = first if first or not c["code"] else c["code"]
            if first and stop_at is None:
                kill(signal.SIGTERM)
                stop_at = time.monotonic() + 10
            if stop_at is not None and time.monotonic() > stop_at:
                kill(signal.SIGKILL)
            if time.monotonic() > deadline:
                kill(signal.SIGKILL)
                for c in children:
                    c["conn"].close()
                text = lambda key: "".join(c[key].read_text(errors="replace") for c in children)  # noqa: E731
                raise subprocess.TimeoutExpired(argv, timeout, text("out"), text("err"))
        stdout = stderr = ""
        for c in children:
            c["conn"].close()
            stdout += c["out"].read_text(errors="replace")
            stderr += c["err"].read_text(errors="replace")
            c["out"].unlink(), c["err"].unlink()
        return subprocess.CompletedProcess(argv, first, stdout, stderr)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
