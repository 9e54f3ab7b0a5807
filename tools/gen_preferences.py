"""Sample K responses per prompt from any model or checkpoint, score them with the reward registry,
and write best-vs-worst pairs (with both scores) as a preference file for algos/dpo_llm.py.

    python -m tools.gen_preferences --model smollm2-135m-instruct --prompts data/chain_sum_1d/train.parquet \\
        --group-size 4 --temperature 1.0 --out data/pairs/train.parquet

With a PPO or GRPO checkpoint (`runs/.../checkpoints/step_N/policy`) this is the "PPO, then
self-play DPO" pipeline. Prompts whose K scores all tie give no pair; the tool reports how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch
import tyro

from common.core import chat, defaults
from common.core import hub as M
from common.core.data import load_prompts, read_table, write_rows
from common.core.errors import UserError
from common.core.rewards import Reward
from common.harness.args import Check, PositiveFloat, PositiveInt
from common.harness.eval import answer, load_any
from common.integrations.engines import tool_engine


@dataclass
class Args:
    prompts: list[str]
    """prompt files in verl's schema"""
    out: str = "pairs.parquet"
    """output .parquet or .jsonl"""
    model: str = defaults.DEFAULT_MODEL
    """model, hub id or checkpoint folder (a LoRA adapter folder loads its base)"""
    group_size: Annotated[int, tyro.conf.arg(aliases=("--k",)), Check(ge=2, note="a pair needs two responses")] = 4
    """G: responses per prompt (>= 2), as in grpo_llm.py"""
    temperature: PositiveFloat = 1.0
    """sampling temperature"""
    max_new_tokens: PositiveInt = 64
    """response length limit"""
    num_prompts: Annotated[Optional[int], Check(gt=0)] = None
    """use the first N prompts (default: all)"""
    reward: str = "rule:1.0"
    """reward sources (partial credit helps: fewer ties)"""
    reward_fn: Optional[list[str]] = None
    """path/to/file.py:fn replacing the data_source registry for every row; repeat for several (summed with
    --reward-weights)"""
    reward_weights: Optional[list[float]] = None
    """weights of the --reward-fn functions, in order (default: 1 each); each is logged as reward/<fn>"""
    batch_size: PositiveInt = 32
    """sequences per generate call"""
    seed: int = 0
    """sampling seed"""
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = "hf"
    """hf: our decoding loop; vllm: a vLLM engine in this process, loaded with the model's weights (docs/rollout.md);
    vllm-server: vLLM's own server (docs/distributed.md)"""
    vllm_server_url: str = ""
    """vllm-server: a running `vllm serve` to use (empty: one is started for the model)"""
    vllm_gpu_memory_utilization: Annotated[float, Check(gt=0, le=1)] = 0.5
    """vllm on GPUs: the share of GPU memory the engine may take"""
    vllm_kv_cache_gb: PositiveFloat = 1.0
    """vllm on CPU: KV-cache space (GiB)"""


def main(args: Args) -> dict:
    tok = chat.load_tokenizer(args.model)
    rows = load_prompts(args.prompts, tok, max_prompt_length=10_000)
    raw = [r for f in args.prompts for r in read_table(f)]
    if args.num_prompts is not None:
        rows, raw = rows[: args.num_prompts], raw[: args.num_prompts]
    reward = Reward(args.reward, args.reward_fn, max_new_tokens=args.max_new_tokens, reward_weights=args.reward_weights)
    reward.check({r.data_source for r in rows})
    model = load_any(M.resolve_model_path(args.model), tok).eval()
    engine = tool_engine(
        args.rollout_engine,
        args.model,
        tok,
        model,
        None,
        args.vllm_gpu_memory_utilization,
        args.vllm_kv_cache_gb,
        args.vllm_server_url,
    )
    responses, lengths, is_eos = answer(
        model,
        tok,
        rows,
        args.max_new_tokens,
        args.batch_size,
        args.group_size,
        args.temperature,
        args.seed,
        with_lengths=True,
        engine=engine,
    )
    # real response lengths (the `length` term) and EOS flags (the `model` term), per sample
    scores = torch.stack(
        [
            reward(
                rows, [r[k] for r in responses], torch.tensor([n[k] for n in lengths]), is_eos=[e[k] for e in is_eos]
            )[0]
            for k in range(args.group_size)
        ],
        1,
    )  # (N, K)
    pairs, ties = [], 0
    for i, (row, src) in enumerate(zip(rows, raw)):
        best, worst = scores[i].argmax().item(), scores[i].argmin().item()
        if scores[i, best] == scores[i, worst]:
            ties += 1
            continue
        pairs.append(
            {
                "prompt": src["prompt"],
                "chosen": responses[i][best],
                "rejected": responses[i][worst],
                "chosen_score": scores[i, best].item(),
                "rejected_score": scores[i, worst].item(),
                "data_source": row.data_source,
            }
        )
    if not pairs:
        raise UserError(
            f"all {len(rows)} prompts tied: no pair written (raise --group-size or --temperature, or use a partial-credit reward)"
        )
    write_rows(pairs, args.out)
    report = {"prompts": len(rows), "pairs": len(pairs), "tied": ties, "mean_score": scores.mean().item()}
    print(f"wrote {args.out}: {report}")
    return report


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
