"""The Python tool on a code-execution service (`--tool-sandbox remote --tool-sandbox-url URL`): for runs whose tool
calls outgrow the trainer's cores, the code goes to a SandboxFusion server (bytedance/SandboxFusion, the service
verl's sandbox rewards and tools call; its client package is `sandbox-fusion` on PyPI), which runs it in its own
isolation on its own machines.

The wire format is SandboxFusion's `POST /run_code`:
    request  {"code": str, "language": "python", "run_timeout": s, "memory_limit_MB": MiB}
    answer   {"status": "Success" | "Failed" | "SandboxError", "message": str,
              "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code": int | null,
                             "stdout": str, "stderr": str, "execution_time": s, ...} | null, ...}
Written on common.integrations.remote_rewards.post_json (urllib) rather than the sandbox-fusion client: that client
retries five times with no bound on the whole call, and would follow a redirect with the request's credentials. Here one
call is bounded (its run timeout + SLACK_S, each try; `retries` tries more for no answer or a 5xx), a redirect is
refused (the key in SANDBOX_FUSION_API_KEY, sent as a bearer token, never goes to another address), and a service that
fails after its retries raises SandboxServiceError, which the tool environment counts (env/tool_service_errors) and
shows the model as a failed call; the run goes on.
"""

from __future__ import annotations

import functools
import os

from common.core.errors import UserError
from common.integrations.remote_rewards import ServiceConfig, ServiceError, post_json

SLACK_S = 10.0  # seconds past the run timeout for the service's queue, start-up and the answer's transfer


class SandboxServiceError(ServiceError):
    """The sandbox service gave no usable answer for one call (after its retries)."""


def endpoint(url: str) -> str:
    """The /run_code address of `url` (a server's base URL or the endpoint itself); a one-line error for none."""
    if not url.startswith(("http://", "https://")):
        raise UserError(f"--tool-sandbox-url {url!r}: expected the SandboxFusion server's http(s):// address "
                        "(e.g. http://sandbox:8080), needed by --tool-sandbox remote")  # fmt: skip
    base = url.rstrip("/")
    return base if base.endswith("/run_code") else base + "/run_code"


def _answer(out) -> dict:
    """A SandboxFusion answer, checked: ValueError (a malformed answer, retried) where it is not one."""
    if not isinstance(out, dict) or out.get("status") not in ("Success", "Failed", "SandboxError"):
        raise ValueError(f"answered {str(out)[:200]!r}, not a SandboxFusion run_code answer")
    run = out.get("run_result")
    if out["status"] != "SandboxError" and not isinstance(run, dict):
        raise ValueError(f"answered status {out['status']!r} without a run_result")
    return out


def run_remote(code: str, url: str, timeout: float = 5.0, memory_mb: int = 512, max_chars: int = 1000,
               retries: int = 1) -> tuple[str, bool]:  # fmt: skip
    """Run `code` on the SandboxFusion server at `url`: (its stdout and stderr cut to `max_chars`, or what stopped it;
    ok: it finished with exit code 0). Raises SandboxServiceError where the service fails (module docstring)."""
    target = endpoint(url)
    key = os.environ.get("SANDBOX_FUSION_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"code": code, "language": "python", "run_timeout": timeout, "memory_limit_MB": memory_mb}
    cfg = ServiceConfig(target, timeout=timeout + SLACK_S, retries=retries, concurrency=1, backoff=0.5)
    try:
        out = post_json(target, body, cfg, headers=headers, check=_answer)
    except ServiceError as e:
        raise SandboxServiceError(str(e)) from None
    if out["status"] == "SandboxError":  # the service's own fault, not the code's
        raise SandboxServiceError(f"{target}: the sandbox failed: {str(out.get('message'))[:200]}")
    run = out["run_result"]
    text = (run.get("stdout") or "") + (run.get("stderr") or "")
    note = ""
    if run.get("status") == "TimeLimitExceeded":
        note = f"[timed out after {timeout:.1f} s]"
    if len(text) > max_chars:
        text = text[:max_chars] + "\n[output truncated]"
    ok = out["status"] == "Success" and run.get("return_code") == 0 and not note
    return (text + ("\n" if text and note else "") + note).strip(), ok


@functools.cache
def check_service(url: str) -> None:
    """Raise UserError (one line naming the URL) now, at start-up, where the service at `url` does not run
    `print('ok')`; once per process."""
    try:
        out, ok = run_remote("print('ok')", url, timeout=10.0)
    except ServiceError as e:
        raise UserError(f"--tool-sandbox remote: {e}") from None
    if not ok or out != "ok":
        raise UserError(f"--tool-sandbox remote: {endpoint(url)} did not run print('ok'): {out[-200:]!r}")
