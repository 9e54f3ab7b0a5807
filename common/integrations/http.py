"""HTTP with bounded waits for the integrations that talk to a server (vLLM's, a reward or sandbox service):
`Http` (JSON calls, no proxy), `bounded` (a call on a thread with a deadline), a free port, and this machine's
address as another host sees it.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from common.core.errors import EngineFailed

# no proxy: a cluster's HTTP_PROXY would otherwise carry the trainer's calls to its own server (localhost included)
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """JSON over HTTP with a deadline per call (the whole call, not each socket read: a server that drips its answer
    is bounded too). Failures are one-line `EngineFailed`s naming the route."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _once(self, path: str, body, timeout: float):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with _DIRECT.open(req, timeout=timeout) as r:
            raw = r.read()
        try:
            return json.loads(raw) if raw else None
        except ValueError:  # some routes answer in text ("Success: LoRA adapter ... added")
            return raw.decode(errors="replace")

    def call(self, path: str, body=None, timeout: float | None = None):
        return self.call_all([(path, body)], timeout)[0]

    def call_all(self, calls: list[tuple[str, object]], timeout: float | None = None, concurrency: int = 64) -> list:
        """Several calls, at most `concurrency` in flight (the server batches them); each answer within `timeout`
        seconds of being sent, or EngineFailed: a healthy server working through many long requests is waited for
        as long as it keeps answering each within its own deadline, a hung one ends the run one deadline after the
        last answer. Daemon threads: a call that never answers cannot hold the process at exit."""
        timeout = timeout or self.timeout
        out, done, todo = [None] * len(calls), queue.Queue(), queue.Queue()
        started = {}  # call index -> when it was sent
        for i in range(len(calls)):
            todo.put(i)

        def worker():
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                started[i] = time.time()
                try:
                    out[i] = self._once(*calls[i], timeout)
                    done.put((i, None))
                except Exception as e:  # reported below, in the caller's thread
                    done.put((i, e))

        for _ in range(min(concurrency, len(calls))):
            threading.Thread(target=worker, daemon=True).start()
        finished = set()
        while len(finished) < len(calls):
            try:
                i, err = done.get(timeout=0.5)
            except queue.Empty:
                late = [j for j, t0 in list(started.items()) if j not in finished and time.time() - t0 > timeout]
                if late:
                    raise self._late(calls[late[0]][0], timeout, len(finished), len(calls)) from None
                continue
            if isinstance(err, TimeoutError):  # the socket's own timeout (a silent server) came first
                raise self._late(calls[i][0], timeout, len(finished), len(calls)) from None
            if err is not None:
                raise EngineFailed(f"--rollout-engine vllm-server: {self.url}{calls[i][0]}: {_why(err)}") from err
            finished.add(i)
        return out

    def _late(self, path: str, timeout: float, answered: int, total: int) -> EngineFailed:
        return EngineFailed(
            f"--rollout-engine vllm-server: {self.url}{path} did not answer within {timeout:g} s "
            + (
                f"(--vllm-server-timeout; {answered} of {total} requests answered)"
                if total > 1
                else "(--vllm-server-timeout)"
            )
        )


def _why(e: Exception) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            detail = e.read().decode(errors="replace")[:300]
        except Exception:
            detail = ""
        return f"HTTP {e.code} {detail}".strip()
    if isinstance(e, urllib.error.URLError):
        return f"cannot reach the server ({e.reason})"
    return f"{type(e).__name__}: {e}"


def bounded(fn, timeout: float, what: str):
    """fn() on a daemon thread, its result within `timeout` seconds, else EngineFailed (a collective that never
    returns must not hang the run: the thread is left behind, and the run ends)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # reported in the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise EngineFailed(
            f"--rollout-engine vllm-server: {what} did not finish within {timeout:g} s (--vllm-server-timeout)"
        )
    if "error" in out:
        e = out["error"]
        raise EngineFailed(f"--rollout-engine vllm-server: {what} failed: {type(e).__name__}: {e}") from e
    return out.get("value")


def route_address(host: str) -> str:
    """This machine's address as `host` sees it: the source address of the route to it (a UDP socket's connect sends
    nothing). `gethostbyname(gethostname())` is often 127.0.1.1 (Debian's /etc/hosts), which another node cannot
    reach."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def no_proxy(host: str) -> None:
    """Add `host` to NO_PROXY / no_proxy, so libraries that follow HTTP(S)_PROXY (requests) reach it directly, as this
    module's own calls do."""
    for var in ("NO_PROXY", "no_proxy"):
        names = [n for n in os.environ.get(var, "").split(",") if n]
        if host not in names:
            os.environ[var] = ",".join([*names, host])
