"""Side-by-side evaluation of several models or checkpoints on the same prompts.

    python -m tools.evaluate --models smollm2-135m-instruct runs/ppo_llm__.../checkpoints/step_100/policy \\
        --data data/chain_sum/test.parquet --out eval.md

Greedy answers by default (`--samples k --temperature t` for sampled answers). Prints reward and
exact-match accuracy per model and per data_source, and writes a markdown file showing each
prompt with every model's answer. `--n K` adds K sampled answers per prompt and reports pass@1,
pass@k (unbiased estimator) and maj@K (majority vote over the extracted answers) next to the greedy
accuracy. Any checkpoint folder is a model (a LoRA adapter is merged onto its base).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

from common.core import chat, defaults
from common.core import hub as M
from common.core.data import load_prompts
from common.core.envs import evaluate_with_env
from common.core.rewards import Reward
from common.harness.args import Check, EnvArgs, Group, NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, group
from common.harness.eval import answer, load_any, sampled_metrics, score
from common.integrations.engines import tool_engine
from common.integrations.inputs import episodes_from_args


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: [defaults.DEFAULT_MODEL])
    """models or checkpoint folders to compare"""
    data: list[str] = field(default_factory=list)
    """prompt files (verl schema); default: the built-in task's test split"""
    num_prompts: PositiveInt = 64
    """prompts evaluated (the first N)"""
    max_new_tokens: PositiveInt = 64
    """answer length limit"""
    samples: PositiveInt = 1
    """answers per prompt"""
    temperature: NonNegFloat = 0.0
    """0: greedy"""
    n: NonNegInt = 0
    """K > 1: also sample K answers per prompt at --sample-temperature and report pass@k (unbiased) and maj@K"""
    sample_temperature: Annotated[float, Check(gt=0, note="greedy accuracy is always reported")] = 1.0
    """temperature of the --n samples"""
    reward: str = "rule:1.0"
    """reward sources (as in the training scripts)"""
    reward_fn: Optional[list[str]] = None
    """path/to/file.py:fn replacing the data_source registry for every row; repeat for several (summed with
    --reward-weights)"""
    reward_weights: Optional[list[float]] = None
    """weights of the --reward-fn functions, in order (default: 1 each); each is logged as reward/<fn>"""
    batch_size: PositiveInt = 16
    """prompts per generate call"""
    out: Optional[str] = None
    """markdown file with every model's answer per prompt"""
    json_out: Optional[str] = None
    """write the scores as JSON here"""
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = "hf"
    """hf: our decoding loop; vllm: a vLLM engine in this process, loaded with the model's weights (docs/rollout.md);
    vllm-server: vLLM's own server (docs/distributed.md)"""
    vllm_server_url: str = ""
    """vllm-server: a running `vllm serve` to use (empty: one is started for the model)"""
    vllm_gpu_memory_utilization: Annotated[float, Check(gt=0, le=1)] = 0.5
    """vllm on GPUs: the share of GPU memory the engine may take"""
    vllm_kv_cache_gb: PositiveFloat = 1.0
    """vllm on CPU: KV-cache space (GiB)"""
    env: Group[EnvArgs] = group(EnvArgs)
    """--env tools|feedback|file.py:Class: each model also answers through the environment (greedy, --max-turns, ...),
    a row "<model> + <env>" next to its plain row: accuracy with and without tools"""


def main(args: Args) -> dict:
    from common.core.tasks import default_env_files, default_task_files, is_hub_spec

    tok = chat.load_tokenizer(args.models[0])
    # default: the built-in task's test split; a hub --env's held-out games (seeds never trained on)
    data = args.data or [default_env_files(args.env.env)[1] if is_hub_spec(args.env.env) else default_task_files()[1]]
    rows = load_prompts(data, tok, max_prompt_length=10_000)[: args.num_prompts]
    reward = Reward(args.reward, args.reward_fn, max_new_tokens=args.max_new_tokens, reward_weights=args.reward_weights)
    reward.check({r.data_source for r in rows})
    results, answers, engine = {}, {}, None
    episodes = episodes_from_args(args.env, tok, reward, "cpu")  # --env: scored by the same reward
    for name in args.models:
        model = load_any(
            M.resolve_model_path(name),
            chat.load_tokenizer(name) if Path(M.resolve_model_path(name), "tokenizer_config.json").exists() else tok,
        ).eval()
        engine = tool_engine(
            args.rollout_engine,
            name,
            tok,
            model,
            engine,
            args.vllm_gpu_memory_utilization,
            args.vllm_kv_cache_gb,
            args.vllm_server_url,
        )  # vllm: one engine, each model's weights pushed in turn
        answers[name], lengths, is_eos = answer(
            model,
            tok,
            rows,
            args.max_new_tokens,
            args.batch_size,
            args.samples,
            args.temperature,
            with_lengths=True,
            engine=engine,
        )
        results[name] = score(rows, answers[name], reward, lengths, is_eos)
        if args.n > 1:
            sampled, s_lengths, s_eos = answer(
                model,
                tok,
                rows,
                args.max_new_tokens,
                args.batch_size,
                args.n,
                args.sample_temperature,
                seed=1,
                with_lengths=True,
                engine=engine,
            )
            for src, d in sampled_metrics(rows, sampled, reward, s_lengths, s_eos).items():
                results[name][src].update(d)
        if episodes is not None:
            with_env = f"{name} + {args.env.env}"
            results[with_env], transcripts = evaluate_with_env(
                episodes, model, rows, args.max_new_tokens, args.batch_size, engine
            )
            answers[with_env] = [[t] for t in transcripts]
        del model
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(rows)} prompts from {', '.join(data)}")
    extra_cols = list(dict.fromkeys(k for r in results.values() for k in r["all"] if k.startswith(("pass@", "maj@"))))
    extra_cols += (
        ["turns", "tool_calls", "tool_call_rate", *(k for k in episodes.info_keys if not k.endswith("_s"))]
        if episodes is not None
        else []
    )
    extra_cols = list(dict.fromkeys(extra_cols))
    for col in ("model", "data_source", "reward", "accuracy", *extra_cols, "n"):
        table.add_column(col)
    for name, res in results.items():
        for src, d in res.items():
            table.add_row(
                name,
                src,
                f"{d['reward']:.3f}",
                f"{d['accuracy']:.3f}",
                *(f"{d[c]:.3f}" if c in d else "" for c in extra_cols),
                str(d["n"]),
            )
    Console().print(table)
    if args.out:
        lines = [f"# Side by side: {len(rows)} prompts\n"]
        for i, row in enumerate(rows):
            lines.append(f"## Prompt {i} ({row.data_source}, answer: {row.ground_truth})\n\n```\n{row.text}\n```\n")
            for name in answers:
                lines.append(f"**{name}**\n\n```\n{answers[name][i][0]}\n```\n")
        Path(args.out).write_text("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
