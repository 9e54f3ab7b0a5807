"""A bf16-safe AdamW for weights stored in bfloat16 (`--dtype bfloat16`; the default trains float32 weights).

torch's AdamW on bfloat16 parameters rounds every update to the nearest bf16 value: a step below half a unit in
the last place (ULP) of a weight is lost. At the RL learning rates (5e-6) that is most of them: on a tiny Llama,
10 steps change 7.7 % of the bf16 weights against 100 % in float32, and norm weights (~1, ULP 2^-7) never move
(issue 32.1; benchmarks/bf16_update.py measures it). `KahanAdamW` keeps, per bf16 parameter, a bf16 buffer of
what rounding dropped (Kahan-compensated summation, as in Zamirai et al. 2020 "Revisiting BFloat16 Training" and
optimi's `kahan_sum`), and adds it back at the next step: the stored weights follow the float32 trajectory
rounded to bf16, for 2 more bytes per parameter (a float32 master copy costs 4). Moments are float32. float32
parameters take the plain AdamW update (the same arithmetic as torch.optim.AdamW, tested against it)."""

from __future__ import annotations

import math
import os

import torch

from common.core.errors import UserError


class KahanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, torch's defaults) with Kahan-compensated updates of
    low-precision parameters. State per parameter: step, exp_avg, exp_avg_sq (float32), and `kahan_comp` (the
    parameter's dtype) for non-float32 parameters."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state tensor but `step` to its parameter's dtype, which would round
        the float32 moments of a bf16 parameter to bf16 on resume: put them back from the saved values."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, ids):
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state_dict["state"].get(i, {}):
                    self.state[p][key] = state_dict["state"][i][key].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if p.dtype != torch.float32:
                        state["kahan_comp"] = torch.zeros_like(p)
                state["step"] += 1
                t = int(state["step"].item())
                g = p.grad.float()
                state["exp_avg"].lerp_(g, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                w = p.float()  # float32 view of the weights as stored
                update = -lr * (state["exp_avg"] / (1 - beta1**t)) / denom - lr * wd * w  # (same shape as p)
                if "kahan_comp" not in state:
                    p.add_(update)
                    continue
                exact = w + state["kahan_comp"].float() + update  # where the weight should be
                p.copy_(exact)  # rounded to the parameter's dtype
                state["kahan_comp"].copy_(exact - p.float())  # what the rounding dropped, carried to the next step
        return loss


def adamw(model: torch.nn.Module, optim, n_updates: int, lr: float | None = None):
    """(AdamW over `model`'s trainable parameters, its transformers learning-rate schedule) from a script's
    OptimArgs `optim`: --learning-rate (or `lr`), --weight-decay, --lr-scheduler and --warmup-steps over
    `n_updates` optimizer steps. fused: one kernel per step over all parameters (5-9x faster than foreach on
    CPU: docs/performance.md). Weights not in float32 (--dtype bfloat16) get `KahanAdamW` (below)."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=lr or optim.learning_rate, weight_decay=optim.weight_decay)
    if optim.optim != "adamw":
        opt = adamw_8bit(params, optim.optim, kw)
    elif all(p.dtype == torch.float32 for p in params):
        opt = torch.optim.AdamW(params, **kw, fused=True)
    else:  # bf16 weights (--dtype bfloat16): torch's AdamW would round away most RL-sized updates
        opt = KahanAdamW(params, **kw)
    sched = get_scheduler(optim.lr_scheduler, opt, num_warmup_steps=optim.warmup_steps, num_training_steps=n_updates)
    return opt, sched


def adamw_8bit(params: list, name: str, kw: dict):
    """--optim adamw_8bit / paged_adamw_8bit: bitsandbytes' AdamW with blockwise 8-bit moments (Dettmers et al. 2022;
    TRL's `optim="adamw_8bit"`): 2 bytes of state per parameter instead of 8; tensors under 4096 elements (norms,
    biases) keep float32 moments (bitsandbytes' min_8bit_size). Plain parameters only: FSDP2 / TP shards (DTensor)
    and DeepSpeed's own optimizer path are refused by name."""
    from torch.distributed.tensor import DTensor

    launched = [os.environ.get(f"ACCELERATE_USE_{k}", "false").lower() == "true" for k in ("DEEPSPEED", "FSDP")]
    if any(launched) or any(isinstance(p, DTensor) for p in params):
        raise UserError(
            f"--optim {name}: not under FSDP2, --tp-size or DeepSpeed here (their sharded states); use adamw"
        )
    if name == "paged_adamw_8bit" and not torch.cuda.is_available():
        raise UserError(
            "--optim paged_adamw_8bit: pages optimizer state between GPU and CPU memory; needs CUDA (adamw_8bit runs on CPU)"
        )
    import bitsandbytes as bnb

    return (bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit)(params, **kw)
