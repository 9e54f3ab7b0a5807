"""A local server speaking SandboxFusion's `POST /run_code` (the requests and answers are the `sandbox-fusion`
package's own pydantic models, so a field we send or read that the service does not have fails here), running the
code in this project's namespaces sandbox. It records each request's headers and can be told to misbehave: answer
500, answer a SandboxError, redirect elsewhere, or hang."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sandbox_fusion.models import CommandRunResult, CommandRunStatus, RunCodeRequest, RunCodeResponse, RunStatus

from common.integrations.sandbox import run_python


class FusionServer:
    def __init__(self):
        self.requests: list[dict] = []  # {"path", "headers", "body"} per request
        self.mode = "ok"  # ok | 500 | sandbox_error | redirect:<url> | hang
        self.fail_first = 0  # answer 500 to this many requests first, then as `mode`
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                mode = "500" if server.fail_first > 0 else server.mode
                server.fail_first -= 1
                if mode == "hang":
                    time.sleep(30)
                if mode.startswith("redirect:"):
                    self.send_response(307)
                    self.send_header("Location", mode.split(":", 1)[1])
                    self.end_headers()
                    return
                if mode == "500" or self.path != "/run_code":
                    self.send_response(500 if mode == "500" else 404)
                    self.end_headers()
                    return
                req = RunCodeRequest(**body)
                assert req.language == "python", req.language
                if mode == "sandbox_error":
                    answer = RunCodeResponse(status=RunStatus.SandboxError, message="executor pod lost")
                else:
                    t0 = time.time()
                    out, ok = run_python(req.code, timeout=req.run_timeout)
                    timed_out = "[timed out after" in out
                    run = CommandRunResult(
                        status=CommandRunStatus.TimeLimitExceeded if timed_out else CommandRunStatus.Finished,
                        execution_time=time.time() - t0,
                        return_code=None if timed_out else (0 if ok else 1),
                        stdout="\n".join(x for x in out.splitlines() if not x.startswith("[timed out after"))
                        if ok or timed_out
                        else "",
                        stderr="" if ok or timed_out else out,
                    )
                    answer = RunCodeResponse(status=RunStatus.Success if ok else RunStatus.Failed, message="",
                                             run_result=run)  # fmt: skip
                data = answer.json().encode()  # (the package's models are pydantic.v1 ones)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
