"""What the tests of test_vllm_server.py share (tests/*/test_vllm_server.py: the tiers, and other test modules)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


# ---------------------------------------------------------------------------------------------
# Bounds and refusals, against a stand-in server
# ---------------------------------------------------------------------------------------------
class _Fake:
    """A stand-in vLLM server on localhost: `routes[path] = fn(body) -> (status, dict | bytes, delay_s, drip_s)`."""

    def __init__(self, **routes):
        ok = lambda body: (200, {}, 0, 0)
        self.routes = {"/health": ok, "/weight_info": lambda b: (200, {"weight_version": "0"}, 0, 0),
                       "/inference/v1/generate": lambda b: (200, _answer([5, 2], "0"), 0, 0), **routes}  # fmt: skip
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _serve(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fn = fake.routes.get(self.path.split("?")[0], ok)
                status, payload, delay, drip = fn(body)
                time.sleep(delay)
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    for i in range(len(raw)):  # drip: one byte at a time
                        self.wfile.write(raw[i : i + 1])
                        self.wfile.flush()
                        time.sleep(drip)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            do_GET = do_POST = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _answer(ids, version, logprob=-1.0):
    return {"choices": [{"token_ids": ids, "stop_reason": None, "weight_versions": [{"version": version, "start": 0,
            "end": len(ids)}], "logprobs": {"content": [{"token_id": t, "logprob": logprob} for t in ids]}}]}  # fmt: skip


def _model():
    return torch.nn.Linear(3, 2)


def _queries():
    return torch.tensor([[0, 7, 8], [9, 10, 11]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
