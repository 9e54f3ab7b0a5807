"""The same PPO run under each distributed engine on 2 processes: how far each ends from DDP, and
what it costs in wall time and checkpoint size. On a GPU machine pass GPU configs and a real model.

    python benchmarks/distributed_engines.py [--model PATH] [--steps 2]
        [--configs cpu_2proc cpu_2proc_fsdp2 cpu_2proc_zero2 cpu_2proc_zero3]

Without --model it builds the tests' tiny random model (2 layers, hidden 64) into a temp folder.
Prints a markdown table; the first config is the reference.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from safetensors.torch import load_file  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--configs", nargs="*", default=["cpu_2proc", "cpu_2proc_fsdp2", "cpu_2proc_zero2", "cpu_2proc_zero3"]
    )
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="engines-"))
    model = a.model
    if model is None:
        from common.core.models import tiny_model

        model = tiny_model(tmp / "tiny", init_std=0.2)
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": f"count to {i}", "data_source": "toy"}) + "\n")
    flags = [
        "--model-name-or-path",
        model,
        "--train-files",
        prompts,
        "--reward-fn",
        f"{REPO}/tests/helpers/toy_reward.py:compute_score",
        "--total-steps",
        a.steps,
        "--batch-size",
        4,
        "--mini-batch-size",
        2,
        "--micro-batch-size",
        1,
        "--max-new-tokens",
        6,
        "--learning-rate",
        1e-3,
        "--critic-learning-rate",
        1e-3,
        "--eval-every",
        0,
        "--kl-coef",
        0.1,
    ]
    runs = {}
    for cfg in a.configs:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / f"configs/accelerate/{cfg}.yaml"),
            str(REPO / "algos/ppo_llm.py"),
            *map(str, flags),
            "--output-dir",
            str(tmp / cfg),
        ]
        t = time.time()
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "TOY_MODEL": str(model)})
        runs[cfg] = (next((tmp / cfg).iterdir()), time.time() - t)

    def weights(run):
        return load_file(run / f"checkpoints/step_{a.steps}/policy/model.safetensors")

    ref_run = runs[a.configs[0]][0]
    ref, base = weights(ref_run), load_file(next(Path(model).glob("*.safetensors")))
    update = sum((ref[k] - base[k]).abs().sum().item() for k in ref if k in base)
    print(f"PPO, {a.steps} iterations of 2 minibatches x 2 micro-batches, 2 processes; reference: {a.configs[0]}\n")
    print(
        "| config | engine | policy: sum abs diff / sum abs update | max abs diff | final loss/value | wall s "
        "| rank-0 peak memory GB | checkpoint MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cfg, (run, wall) in runs.items():
        w = weights(run)
        diff = sum((w[k] - ref[k]).abs().sum().item() for k in ref)
        mx = max((w[k] - ref[k]).abs().max().item() for k in ref)
        record = json.loads((run / "args.json").read_text())
        engine = record["distributed_type"] + (f" ZeRO-{record['zero_stage']}" if record.get("zero_stage") else "")
        last = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
        size = sum(f.stat().st_size for f in (run / f"checkpoints/step_{a.steps}").rglob("*") if f.is_file()) / 2**20
        print(
            f"| {cfg} | {engine} | {diff / update:.2e} | {mx:.2e} | {last['loss/value']:.6f} | {wall:.1f} "
            f"| {last['perf/peak_mem_gb']:.2f} | {size:.1f} |"
        )


if __name__ == "__main__":
    main()
