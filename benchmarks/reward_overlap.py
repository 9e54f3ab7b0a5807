"""Rewards scored while the batch decodes (common.core.sampling.sample_and_score) against scoring after the rollout, on
SmolLM2-135M-Instruct: 32 chain_sum_1d prompts (8 distinct x 4) sampled to <= 64 tokens, scored by a reward service
(a local HTTP server that answers after `--latency` seconds per request plus `--per-row` seconds per response, as a
judge or a remote reward model would; requests of `--batch-size`, `--concurrency` at once). The same seeds, so the
same responses and scores; medians of `--repeats`. Run it alone on the machine.

    python benchmarks/reward_overlap.py [--latency 0.5 --per-row 0.02]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def serve(latency: float, per_row: float) -> tuple[ThreadingHTTPServer, str]:
    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(latency + per_row * len(body["responses"]))
            data = json.dumps({"scores": [float(len(r) % 7) for r in body["responses"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/score"


def main():
    import torch

    from common.core import chat, defaults
    from common.core import models as M
    from common.core.data import load_prompts
    from common.core.generation import generate, tokenize_queries
    from common.core.rewards import Reward
    from common.core.sampling import sample_and_score
    from common.core.tasks import default_task_files
    from common.integrations.remote_rewards import RemoteScorer, ServiceConfig

    p = argparse.ArgumentParser()
    p.add_argument("--latency", type=float, default=0.5)
    p.add_argument("--per-row", type=float, default=0.02)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    server, url = serve(a.latency, a.per_row)
    tok = chat.load_tokenizer(defaults.DEFAULT_MODEL)
    chat.set_prompt_format(tok, True, None, None)
    model = M.load_causal_lm(defaults.DEFAULT_MODEL, tok).eval()
    rows = load_prompts(default_task_files("chain_sum_1d")[0], tok, "prompt", "data_source", 256, False, lambda *_: 0)
    rows = [r for r in rows[:8] for _ in range(4)]
    q, qm = tokenize_queries(tok, [r.text for r in rows])
    cfg = ServiceConfig(url, batch_size=a.batch_size, concurrency=a.concurrency)
    reward = Reward("rule:1.0,remote:0.5", remote=RemoteScorer(cfg))

    def after(seed):
        t0 = time.time()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            ro = generate(model, tok, q, qm, 64, 1.0, seeds=[seed * 1000 + i for i in range(32)])
        t_gen = time.time() - t0
        texts = tok.batch_decode(ro.responses, skip_special_tokens=True)
        scores = reward(rows, texts, ro.response_mask.sum(1), "cpu", ro.is_eos)[0]
        return time.time() - t0, t_gen, scores, reward.remote.requests

    def during(seed):
        t0 = time.time()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            seeds = [seed * 1000 + i for i in range(32)]
            _, _, (scores, _, _) = sample_and_score(model, tok, q, qm, rows, reward, "cpu", max_new_tokens=64,
                                                    temperature=1.0, seeds=seeds)  # fmt: skip
        return time.time() - t0, float("nan"), scores, reward.remote.requests

    after(0)  # warm-up
    res = {}
    for name, fn in (("scored after the rollout", after), ("scored as rows finish", during)):
        runs = []
        for seed in range(1, a.repeats + 1):
            before = reward.remote.requests
            total, t_gen, scores, req = fn(seed)
            runs.append((total, t_gen, req - before, scores))
        res[name] = runs
    same = all(torch.equal(x[3], y[3]) for x, y in zip(*res.values()))
    print(f"\n32 responses <= 64 tokens; service: {a.latency} s + {a.per_row} s/response per request, requests of "
          f"<= {a.batch_size}, {a.concurrency} at once; medians of {a.repeats}; same scores: {same}\n")  # fmt: skip
    print("| scoring | rollout + scores s | of which decoding s | requests |")
    print("|---|---|---|---|")
    for name, runs in res.items():
        med = lambda k: statistics.median(r[k] for r in runs)
        print(f"| {name} | {med(0):.2f} | {med(1):.2f} | {med(2):.0f} |")
    server.shutdown()


if __name__ == "__main__":
    main()
