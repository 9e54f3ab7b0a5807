"""Serve a reward model trained by rm_llm.py over the `--reward-url` protocol (docs/data.md), so RL runs elsewhere
score with it: `--reward rule:1.0,remote:0.5 --reward-url http://HOST:PORT/score`.

    python -m tools.serve_rm runs/rm_llm__.../checkpoints/step_200/model --port 8000

POST /score {"prompts": [...], "responses": [...], "is_eos": [...], ...} -> {"scores": [...]}: each sequence
encoded exactly as rm_llm.py trained on it (the prompt rendered with the reward model's own saved prompt format,
EOS where the response ended with one), the scores normalised as the model's config says: the same numbers as
`--reward-model` in process (tested). GET /health -> {"ok": true}. One model forward at a time (a lock), up to
--batch-size sequences each; the HTTP server is the standard library's, one thread per connection.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated

import tyro

from common.core.data import PromptRow
from common.core.errors import UserError
from common.harness.args import Check, PositiveInt

MAX_REQUEST_BYTES = 8 << 20  # a larger body is refused (413): one client's request cannot hold the model for minutes


@dataclass
class Args:
    model: tyro.conf.Positional[str]
    """the reward model folder (rm_llm.py's checkpoints/step_N/model)"""
    host: str = "127.0.0.1"
    """address to listen on (0.0.0.0: every interface)"""
    port: Annotated[int, Check(ge=0, le=65535)] = 8000
    """port to listen on (0: any free port, printed)"""
    batch_size: PositiveInt = 16
    """sequences per forward"""
    dtype: str = "auto"
    """weights dtype (auto: float32 on CPU, bf16 on GPUs)"""


def make_server(model_path: str, host: str = "127.0.0.1", port: int = 0, batch_size: int = 16, dtype: str = "auto"):
    """A ThreadingHTTPServer scoring with the reward model at `model_path` (not started: call serve_forever)."""
    import torch

    from common.core import chat
    from common.core import models as M
    from common.core.rewards import Reward

    M.check_reward_model(model_path, "tools.serve_rm")
    tok = chat.load_reward_tokenizer(model_path)  # with the prompt format it was trained with
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rm = M.load_reward_model(model_path, tok, dtype).to(device).eval()
    reward = Reward("model:1.0", reward_model=rm, reward_tok=tok, batch_size=batch_size)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (the standard library's name)
            self._send(200, {"ok": True}) if self.path.rstrip("/") == "/health" else self._send(404, {"error": "no"})

        def do_POST(self):  # noqa: N802
            try:
                size = int(self.headers.get("Content-Length", 0))
                if size > MAX_REQUEST_BYTES:
                    self.close_connection = True
                    return self._send(413, {"error": f"a request of {size} bytes: at most {MAX_REQUEST_BYTES}"})
                req = json.loads(self.rfile.read(size))
                prompts, responses = req["prompts"], req["responses"]
                if len(prompts) != len(responses):
                    raise ValueError(f"{len(prompts)} prompts, {len(responses)} responses")
                is_eos = req.get("is_eos") or [False] * len(responses)
            except (ValueError, KeyError, TypeError) as e:
                return self._send(400, {"error": f"bad request: {e}"})
            rows = [PromptRow(p if isinstance(p, str) else "", "", None, messages=p) for p in prompts]
            scores, n = [], batch_size
            for i in range(0, len(rows), n):  # the lock per forward: other clients' batches interleave with ours
                with lock, torch.no_grad():
                    scores += reward._model(rows[i : i + n], responses[i : i + n], is_eos[i : i + n], device).tolist()
            self._send(200, {"scores": [float(s) for s in scores]})

        def log_message(self, *a):  # quiet: one line per request would drown the trainer's logs
            pass

    try:
        return ThreadingHTTPServer((host, port), Handler)
    except (OSError, OverflowError) as e:  # busy, not ours to bind, no such address
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def main(args: Args) -> None:
    server = make_server(args.model, args.host, args.port, args.batch_size, args.dtype)
    host, port = server.server_address[:2]
    print(f"serving {args.model} at http://{host}:{port}/score (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
