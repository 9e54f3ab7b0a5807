"""Where an RL step's memory goes: one GRPO (8 prompts x 4) or PPO (32 prompts) step of the step-time config
(SmolLM2-135M-Instruct, <= 64 sampled tokens, bf16 autocast, micro-batches of 8 rows' budget), run phase by phase in
this process from the scripts' own pieces, with the resident set sampled every 2 ms. Run it alone:

    python benchmarks/memory_breakdown.py --algo grpo                  # both levers (the default)
    python benchmarks/memory_breakdown.py --algo grpo --no-share --full-head
    python benchmarks/memory_breakdown.py --algo sft --length 1024 [--full-head]   # the LM head at SFT's lengths

Each row: the process's resident set when the phase ends, the highest it reached during the phase, and what the
phase added that stays (weights, gradients, optimizer state). `saved for backward` is what autograd holds for one
micro-batch's backward (tensors counted once per storage), split into the (rows x positions x V) logits and the rest.
"""

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


class Sampler:
    """The highest resident set since the last `mark`, sampled every 2 ms by a thread."""

    def __init__(self):
        self.peak, self.stop = rss_gb(), False
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, rss_gb())
            time.sleep(0.002)

    def mark(self):
        time.sleep(0.01)
        peak, now = max(self.peak, rss_gb()), rss_gb()
        self.peak = now
        return now, peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--algo", choices=["grpo", "ppo", "sft"], default="grpo")
    p.add_argument("--length", type=int, default=1024, help="sft: tokens per row (4 rows, one forward + backward)")
    p.add_argument("--no-share", action="store_true", help="every row runs its prompt")
    p.add_argument("--full-head", action="store_true", help="the (B, T, V) logits (CLEANRLHF_LM_HEAD=full)")
    p.add_argument("--trim", action="store_true", help="glibc's malloc_trim(0) at the end of every phase")
    a = p.parse_args()
    if a.full_head:
        os.environ["CLEANRLHF_LM_HEAD"] = "full"
    sampler = Sampler()
    rows_out = []

    def phase(name, note=""):
        if a.trim:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        now, peak = sampler.mark()
        rows_out.append((name, now, peak, note))
        print(f"| {name} | {now:.2f} | {peak:.2f} | {note} |", flush=True)

    import torch
    from accelerate import Accelerator

    from common.core import chat, defaults
    from common.core import models as M
    from common.core.data import load_prompts
    from common.core.forwards import forward_logprobs, forward_values, micro_batches
    from common.core.generation import generate, sequence_attention_mask, tokenize_queries
    from common.core.tasks import default_task_files
    from common.parallel.optim import adamw
    from common.parallel.sharded import prepare_frozen

    torch.set_num_threads(2)
    print(f"\n{a.algo}: share prompts {not a.no_share and a.algo == 'grpo'}, chunked head {not a.full_head}\n")
    print("| phase | RSS at end GB | peak during GB | note |\n|---|---|---|---|")
    phase("torch, transformers, common imported")
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    tok = chat.load_tokenizer(defaults.DEFAULT_MODEL)
    chat.set_prompt_format(tok, True, None, None)
    policy = M.load_causal_lm(defaults.DEFAULT_MODEL, tok)
    n_params = sum(p.numel() for p in policy.parameters())
    phase("policy weights (float32)", f"{n_params / 1e6:.0f} M parameters = {n_params * 4 / 1e9:.2f} GB")
    ref = prepare_frozen(accelerator, M.load_causal_lm(defaults.DEFAULT_MODEL, tok), under_autocast=True)
    phase("reference weights (bf16 linears, float32 embedding)")
    critic = None
    if a.algo == "ppo":
        critic = M.load_value_model(defaults.DEFAULT_MODEL, tok)
        phase("critic weights (float32)")
    from types import SimpleNamespace

    optim = SimpleNamespace(
        optim="adamw", learning_rate=1e-6, weight_decay=0.0, lr_scheduler="constant", warmup_steps=0
    )
    opt, _ = adamw(policy, optim, 10)
    opt_c = adamw(critic, optim, 10)[0] if critic is not None else None
    policy, opt = accelerator.prepare(policy, opt)

    if (
        a.algo == "sft"
    ):  # 4 rows x --length tokens, SFT's log-probs of given tokens (common.core.forwards.token_logprobs)
        from common.core.forwards import token_logprobs

        ids = torch.randint(5, len(tok), (4, a.length), generator=torch.Generator().manual_seed(0))
        for step in (1, 2):
            with accelerator.autocast():
                loss = -token_logprobs(policy, ids, torch.ones_like(ids)).mean()
            loss.backward()
            phase(f"step {step}: forward + backward of 4 x {a.length} tokens")
            opt.step()
            opt.zero_grad(set_to_none=True)
            phase(f"step {step}: optimizer step, gradients freed")
        sampler.stop = True
        print(f"\npeak over the run: {max(r[2] for r in rows_out):.2f} GB")
        return
    G = 4 if a.algo == "grpo" else 1
    n_prompts = 32 // G
    prompts = load_prompts(
        default_task_files("chain_sum_1d")[0], tok, "prompt", "data_source", 256, False, lambda *_: 0
    )
    texts = [r.text for r in prompts[:n_prompts] for _ in range(G)]
    q, qm = tokenize_queries(tok, texts)
    for step in (1, 2):  # the second step holds the Adam moments from its start (the steady state)
        with torch.no_grad(), accelerator.autocast():
            ro = generate(policy, tok, q, qm, 64, 1.0, seeds=list(range(32)), keep_prompt_cache=a.algo == "ppo")
        P, T = q.shape[1], ro.responses.shape[1]
        mask = ro.response_mask
        phase(f"step {step}: generation (KV cache)", f"32 rows, prompt {P}, response <= {T}")
        attn = sequence_attention_mask(qm, T)
        qr = ro.query_responses
        share = G > 1 and not a.no_share
        group = G if share else 1
        micros = micro_batches(list(range(32)), qm, mask, 8, -1, None, group)
        with torch.no_grad(), accelerator.autocast():
            ref_lp = torch.zeros_like(mask)
            for m in micros:
                cut = slice(P - m.p, P + m.t)
                ref_lp[m.ids, : m.t] = forward_logprobs(ref, qr[m.ids, cut], attn[m.ids, cut], m.p, share_prompts=share)
            if critic is not None:
                values = forward_values(critic, qr, attn, P)
        phase(f"step {step}: reference (and critic) forwards, no grad")

        V = len(tok)
        saved = {"logits": 0, "other": 0}

        def pack(x):
            key = (x.untyped_storage().data_ptr(), x.dtype)
            if key not in seen:
                seen.add(key)
                n = x.untyped_storage().nbytes()
                saved["logits" if x.dim() >= 2 and x.shape[-1] == V and x.numel() > V else "other"] += n
            return x

        adv = torch.randn(32)[:, None]
        for k, m in enumerate(micros):
            cut = slice(P - m.p, P + m.t)
            seen = set()
            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x) if k == 0 else None
            with accelerator.autocast():
                if hooks:
                    hooks.__enter__()
                lp, ent = forward_logprobs(
                    policy, qr[m.ids, cut], attn[m.ids, cut], m.p, 1.0, True, share_prompts=share
                )  # (b, t)
                loss = -(adv[m.ids] * lp * mask[m.ids, : m.t]).sum() / mask.sum()
                if critic is not None:
                    v = forward_values(critic, qr[m.ids, cut], attn[m.ids, cut], m.p)
                    loss = loss + ((v - values[m.ids, : m.t]) ** 2 * mask[m.ids, : m.t]).sum() / mask.sum()
                if hooks:
                    hooks.__exit__(None, None, None)
            loss.backward()
        shapes = ", ".join(f"{len(m.ids)}x({m.p}+{m.t})" for m in micros)
        phase(
            f"step {step}: update forward + backward (gradients)",
            f"micro-batches {shapes}; first one saved for backward: logits {saved['logits'] / 1e9:.3f} GB, "
            f"rest {saved['other'] / 1e9:.3f} GB",
        )
        opt.step()
        if opt_c is not None:
            opt_c.step()
        phase(f"step {step}: optimizer step (Adam moments: 8 bytes per parameter)")
        opt.zero_grad(set_to_none=True)
        phase(f"step {step}: gradients freed")
    sampler.stop = True
    print(f"\npeak over the step: {max(r[2] for r in rows_out):.2f} GB")


if __name__ == "__main__":
    main()
