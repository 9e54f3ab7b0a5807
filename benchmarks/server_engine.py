"""The three rollout engines on this machine, SmolLM2-135M-Instruct: generation seconds for GRPO's batch (8 chat
prompts x 4 samples, <= 64 tokens), and the seconds of a weight push after an update, full weights against a LoRA
adapter (r 16, all linear layers), for the colocated vLLM engine and for vLLM's server (started here on localhost,
the folder route). Medians over `--repeats`, after a first (warm-up) call. Run it alone on the machine; the step
times of whole runs are `benchmarks/step_time.py --rows default vllm vllm-server`.

    python benchmarks/server_engine.py [--repeats 5] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.time()
        fn()
        out.append(time.time() - t0)
    return statistics.median(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model

    from common.core import chat, defaults, hub
    from common.core import models as M
    from common.core.generation import generate, tokenize_queries
    from common.core.seeds import mix_seed
    from common.integrations.http import free_port
    from common.integrations.vllm_engine import VLLMEngine
    from common.integrations.vllm_server import ServerEngine, ServerProcess

    dtype = getattr(torch, a.dtype)
    path = str(hub.resolve_model_path(defaults.DEFAULT_MODEL))
    tok = chat.load_tokenizer(path)
    model = M.load_causal_lm(path, tok).eval()
    texts = [f"What is {i} + {2 * i}? Answer with the number." for i in range(8)] * 4
    q, qm = tokenize_queries(
        tok,
        [
            tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
            for t in texts
        ],  # fmt: skip
    )
    port = free_port()
    engines = {
        "colocated vLLM": VLLMEngine(path, tok, max_model_len=512, seed=0, dtype=dtype, lora_rank=16),
        "vLLM server": ServerEngine(
            f"http://127.0.0.1:{port}",
            tok,
            dtype=dtype,
            lora_rank=16,
            start=lambda: ServerProcess(path, port, dtype, 512, 0, lora_rank=16),
        ),  # fmt: skip
    }
    lora = get_peft_model(M.load_causal_lm(path, tok), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    lora.eval()
    print(
        f"{defaults.DEFAULT_MODEL} (Q4_1-dequantised GGUF), engines in {a.dtype}, torch threads {torch.get_num_threads()}"
    )
    print("\n| engine | generation s (32 x <= 64 tokens) | response tokens | tokens/s |\n|---|---|---|---|")
    seeds = [mix_seed(0, 1, i) for i in range(len(q))]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    runs = {"hf (ours)": None, **engines}
    for name, engine in runs.items():
        last = {}

        def gen(engine=engine, last=last):
            with autocast:
                last["g"] = generate(model, tok, q, qm, 64, 1.0, seeds=seeds, engine=engine)

        s = timed(gen, a.repeats)
        n = int(last["g"].response_mask.sum())
        print(f"| {name} | {s:.2f} | {n} | {n / s:.0f} |", flush=True)
    print("\n| engine | push | MB | push s |\n|---|---|---|---|")
    for name, engine in engines.items():
        for what, m, params in (("full weights", model, None), ("LoRA adapter (r 16)", lora, "lora_")):

            def push(m=m, params=params, engine=engine):
                with torch.no_grad():  # a new version: an update changed the weights (or the adapter)
                    for n_, t in m.named_parameters():
                        if params is None or params in n_:
                            t.add_(1e-4)
                            break
                assert engine.sync(m)

            s = timed(push, a.repeats)
            # what goes: the weights in the engine's dtype (written to a file for the server, handed over in memory
            # to the colocated engine), or the adapter's tensors in float32
            sd = m.state_dict() if params is None else {k: v for k, v in m.state_dict().items() if params in k}
            width = 4 if params or dtype == torch.float32 else 2
            mb = sum(v.numel() for v in sd.values()) * width / 2**20
            print(f"| {name} | {what} | {mb:.1f} | {s:.3f} |", flush=True)
    engines["vLLM server"].close()


if __name__ == "__main__":
    main()
