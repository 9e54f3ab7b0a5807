"""What an AdamW step does to weights stored in bfloat16 (issue 32.1): the fraction of weights that move, and how
far the stored weights end from the float32 trajectory, for float32 weights (the default: bf16 compute comes from
autocast), bf16 weights under torch's AdamW (the GPU default before issue 32), and bf16 weights under
common.parallel.optim.KahanAdamW (--dtype bfloat16 now). The same gradients feed every run (the float32 model's, under
bf16 autocast), so only the update arithmetic differs. A tiny random Llama (4 layers, hidden 256).

    python benchmarks/bf16_update.py [--steps 10 100] [--lr 5e-6 1e-6]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.parallel.optim import KahanAdamW  # noqa: E402


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg)


def run(steps: int, lr: float) -> dict:
    model = tiny_llama()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf16_plain = {n: p.detach().to(torch.bfloat16).clone().requires_grad_() for n, p in model.named_parameters()}
    bf16_kahan = {n: p.detach().to(torch.bfloat16).clone().requires_grad_() for n, p in model.named_parameters()}
    opts = {
        "float32 weights, AdamW": torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0),
        "bf16 weights, AdamW": torch.optim.AdamW(bf16_plain.values(), lr=lr, weight_decay=0.0),
        "bf16 weights, KahanAdamW": KahanAdamW(bf16_kahan.values(), lr=lr, weight_decay=0.0),
    }
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, 32), generator=g)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for copy in (bf16_plain, bf16_kahan):
            for n, p in model.named_parameters():
                copy[n].grad = p.grad.to(torch.bfloat16)
        for opt in opts.values():
            opt.step()
    fp32 = {n: p.detach() for n, p in model.named_parameters()}
    comp = {n: opts["bf16 weights, KahanAdamW"].state[p]["kahan_comp"] for n, p in bf16_kahan.items()}
    kahan_exact = {n: bf16_kahan[n].detach().float() + comp[n].float() for n in w0}  # the stored weight + its carry
    runs = dict(zip(opts, (fp32, bf16_plain, bf16_kahan)))
    runs["bf16 weights, KahanAdamW: stored + carried"] = kahan_exact
    out, travel = {}, sum(float((fp32[n] - w0[n]).abs().sum()) for n in w0)
    norms = [n for n in w0 if "norm" in n]
    for name, weights in runs.items():
        start = {n: w0[n].to(bf16_plain[n].dtype).float() if "bf16" in name else w0[n] for n in w0}  # its own w0
        delta = {n: weights[n].detach().float() - start[n] for n in w0}  # the update it made
        moved = lambda names: sum(int((delta[n] != 0).sum()) for n in names) / sum(w0[n].numel() for n in names)
        lost = sum(float((delta[n] - (fp32[n] - w0[n])).abs().sum()) for n in w0)
        out[name] = dict(moved=moved(list(w0)), norm_moved=moved(norms), rel_err=lost / travel)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--lr", type=float, nargs="+", default=[5e-6, 1e-6])
    a = ap.parse_args()
    print(
        "| weights, optimizer | lr | steps | weights moved | norm weights moved | update error: sum |dw - dw_fp32| / sum |dw_fp32| |"
    )
    print("|---|---|---|---|---|---|")
    for lr in a.lr:
        for steps in a.steps:
            for name, r in run(steps, lr).items():
                print(f"| {name} | {lr:g} | {steps} | {r['moved']:.1%} | {r['norm_moved']:.1%} | {r['rel_err']:.3f} |")


if __name__ == "__main__":
    main()
