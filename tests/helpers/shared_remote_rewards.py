"""What the tests of test_remote_rewards.py share (tests/*/test_remote_rewards.py: the tiers, and other test modules)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Stub:
    """A local HTTP server answering POSTs with `answer(body) -> (code, json)`, counting requests."""

    def __init__(self, answer, delay: float = 0.0):
        stub = self
        self.bodies, self.times, self.lock = [], [], threading.Lock()

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.bodies.append(body)
                    stub.times.append(time.time())
                    n = len(stub.bodies)
                time.sleep(delay)
                code, out = answer(body, n)
                data = json.dumps(out).encode() if not isinstance(out, bytes) else out
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
