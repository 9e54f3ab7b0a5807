"""The hf decoding loop's KV cache: tokens per second of common.core.generation.generate at 512 new tokens, with the
preallocated cache (common.core.attention.preallocate_cache: each token written in place) and with transformers'
DynamicLayer (torch.cat: every layer's whole cache copied at every token), in the same process. Rows never stop
early (--ignore-eos: the stop ids are emptied), so every row decodes all the tokens. Run it alone:

    python benchmarks/decode_cache.py [--model smollm2-135m-instruct] [--batch 8] [--max-new-tokens 512]

Prints a markdown table (docs/rollout.md quotes it)."""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.core import (
    attention,  # noqa: E402
    chat,  # noqa: E402
    defaults,
    generation,
)
from common.core import models as M
from common.core.attention import preallocate_cache  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=defaults.DEFAULT_MODEL)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    tok = chat.load_tokenizer(a.model)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = M.load_causal_lm(a.model, tok).eval().to(dev)
    texts = [chat.apply_chat(tok, f"Write a long story about the number {i}.") for i in range(a.batch)]
    q, qm = generation.tokenize_queries(tok, texts)
    q, qm = q.to(dev), qm.to(dev)
    chat.stop_ids = lambda tok: []  # --ignore-eos: every row decodes max_new_tokens
    variants = {"DynamicLayer (torch.cat)": lambda cache, capacity: None, "preallocated": preallocate_cache}
    rates = {k: [] for k in variants}
    for r in range(a.repeats + 1):  # the first round warms up (not counted)
        for name, fn in variants.items():
            attention.preallocate_cache = fn
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = generation.generate(
                    model, tok, q, qm, a.max_new_tokens, temperature=1.0, seeds=list(range(a.batch))
                )
            if dev == "cuda":
                torch.cuda.synchronize()
            n = int(out.response_mask.sum())
            assert n == a.batch * a.max_new_tokens, n
            if r:
                rates[name].append(n / (time.perf_counter() - t0))
    print(f"{a.model}, batch {a.batch}, prompt {q.shape[1]} tokens, {a.max_new_tokens} new tokens, {dev}, "
          f"{torch.get_num_threads()} threads; median of {a.repeats}")  # fmt: skip
    print("| cache | tokens/s |\n|---|---|")
    for name, rs in rates.items():
        print(f"| {name} | {statistics.median(rs):.1f} |")


if __name__ == "__main__":
    main()
