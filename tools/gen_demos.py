"""Tool-use demonstrations for a multi-turn SFT warm start (docs/agents.md, "Teach the tool"), without a bigger model.

Three sources, one output (SFT rows in verl's multi-turn schema: `messages` holding the whole conversation, the
environment's system protocol included, plus `data_source`, `reward_model`, `extra_info.source`):

    # the policy's own successful trajectories (rejection sampling, STaR / RFT): K samples per prompt through --env,
    # kept when their reward reaches --min-reward; --prefix forces the first tokens of the first turn, for a model
    # that never starts a call on its own (the forced text is part of the turn, so SFT teaches it)
    python -m tools.gen_demos --model smollm2-135m-instruct --prompts data/tool_tasks/train.parquet \\
        --env tools --tools python --k 8 --prefix '<tool_call>{"name": "python", "arguments": {"code": "print(' \\
        --out data/demos/policy.jsonl
    # a program per task family writes the call from the generator's own metadata (--source program)
    python -m tools.gen_demos --source program --prompts data/tool_tasks/train.parquet --out data/demos/program.jsonl
    # hand-written demonstrations (docs/agents.md: how to write twenty): each row's assistant turns are replayed
    # through the environment, so the tool results are real, and kept only when they still earn the reward
    python -m tools.gen_demos --source file --demos my_demos.jsonl --out data/demos/hand.jsonl

Every kept conversation is replayed through the same environment that rollouts use, so a tool result in a row is
what the tool printed. Duplicates (the same assistant turns for the same prompt) are removed and at most
--max-per-prompt rows are kept per prompt. A summary per data_source prints tried / kept, the tool-call rate and the
tool errors; --summary-out writes it as JSON.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Annotated, Literal, Optional

import torch

from common.core import chat, hub
from common.core import defaults as M
from common.core.chat import format_tool_call
from common.core.data import DataError, load_prompts, read_files, read_table, write_rows
from common.core.envs import Step
from common.core.errors import UserError
from common.core.rewards import Reward
from common.core.seeds import mix_seed
from common.harness.args import Check, EnvArgs, Group, NonNegInt, PositiveFloat, PositiveInt, group
from common.integrations.inputs import episodes_from_args


@dataclass
class Args:
    prompts: list[str]
    """prompt files in verl's schema (the training split: demonstrations must never come from held-out problems)"""
    out: str = "demos.jsonl"
    """output .jsonl or .parquet: SFT rows for algos/sft_llm.py --train-files"""
    source: Literal["policy", "program", "file"] = "policy"
    """policy: sample --model through --env (rejection sampling); program: a program per task family writes the
    tool call from the problem's metadata (common.core.tasks.tool_program); file: replay --demos (hand-written)"""
    model: str = M.DEFAULT_MODEL
    """--source policy: the sampler, hub id or checkpoint folder (the base, or a trained checkpoint as a teacher)"""
    demos: Optional[list[str]] = None
    """--source file: rows with `messages` (system/user prompt optional: the prompt file's row of the same index is
    used when a row has no user message) and optional `prompt_index`"""
    k: PositiveInt = 8
    """--source policy: trajectories sampled per prompt"""
    temperature: PositiveFloat = 1.0
    """--source policy: sampling temperature"""
    prefix: str = ""
    """--source policy: text forced at the start of the first model turn (e.g. <tool_call>), part of the turn"""
    require_tool: bool = True
    """keep only conversations with at least one tool call that ran without an error"""
    min_reward: float = 1.0
    """keep a conversation when its reward is at least this (rejection sampling's threshold)"""
    max_per_prompt: PositiveInt = 2
    """rows kept per prompt at most (after removing duplicates)"""
    num_prompts: Annotated[Optional[int], Check(gt=0)] = None
    """use the first N prompts (default: all)"""
    max_new_tokens: PositiveInt = 96
    """tokens per model turn"""
    batch_size: PositiveInt = 32
    """trajectories per rollout call"""
    seed: int = 0
    """sampling seed"""
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = "hf"
    """--source policy: hf, or a vLLM engine in this process (docs/rollout.md); vllm-server: vLLM's own server
    (docs/distributed.md)"""
    vllm_server_url: str = ""
    """vllm-server: a running `vllm serve` to use (empty: one is started for the model)"""
    vllm_kv_cache_gb: PositiveFloat = 1.0
    """vllm on CPU: KV-cache space (GiB)"""
    summary_out: Optional[str] = None
    """write the summary (tried / kept per data_source, tool-call rate, tool errors) as JSON here"""
    show: NonNegInt = 2
    """print this many kept conversations"""
    rejected_out: Optional[str] = None
    """also write the conversations not kept (with their reward and why) here: what the sampler did instead"""
    env: Group[EnvArgs] = group(EnvArgs, env="tools", tools="python")
    """the environment the demonstrations go through (the same flags as the training scripts' --env)"""


def replay(episodes, row, turns) -> tuple[list[dict], float, dict]:
    """The conversation that `turns` make in the environment, its reward and its summed Step.info. `turns`: the
    assistant's texts, or a function (messages so far -> the next text). Each turn goes to `step` as a rollout's
    would, so tool results are the tool's real output."""
    next_turn = turns if callable(turns) else lambda msgs, it=iter(turns): next(it, None)
    env = episodes.factory()
    env.score = lambda text: episodes.score(row, text)
    env.max_turns, env.template_tools = episodes.max_turns, episodes.template_tools
    env.tool_format = episodes.tool_format
    messages = env.reset(row)
    messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
    reward, info = 0.0, defaultdict(float)
    try:
        for k in range(1, episodes.max_turns + 1):
            text = next_turn(messages)
            if text is None:
                break
            env.turn, env.final = k, k == episodes.max_turns
            step = env.step(text, [])
            if not isinstance(step, Step):
                raise UserError(f"the environment's step returned {type(step).__name__}, not a Step")
            messages.append({"role": "assistant", "content": text})
            reward += float(step.reward)
            for key, v in step.info.items():
                info[key] += float(v)
            if step.done:
                break
            messages += [dict(m) for m in step.observation or []]
    finally:
        env.close()
    return messages, reward, dict(info)


def from_policy(args, episodes, rows, tok) -> list[tuple[int, list[dict], float, dict]]:
    """K trajectories per prompt from --model through the environment: (prompt index, messages, reward, info)."""
    from common.harness.eval import load_any
    from common.integrations.engines import tool_engine

    model = load_any(hub.resolve_model_path(args.model), tok).eval()
    engine = tool_engine(
        args.rollout_engine, args.model, tok, model, None, 0.5, args.vllm_kv_cache_gb, args.vllm_server_url
    )
    jobs = [(i, j) for i in range(len(rows)) for j in range(args.k)]
    out = []
    for s in range(0, len(jobs), args.batch_size):
        chunk = jobs[s : s + args.batch_size]
        seeds = [mix_seed(args.seed, i, j) for i, j in chunk]
        ro = episodes.run(model, [rows[i] for i, _ in chunk], seeds, engine, args.max_new_tokens,
                          args.temperature, prefix=args.prefix)  # fmt: skip
        for b, (i, _) in enumerate(chunk):
            info = {k.split("/", 1)[1]: float(v[b]) for k, v in ro.stats.items()}
            out.append((i, ro.messages[b], float(ro.scores[b]), info))
        print(f"[gen_demos] sampled {min(s + args.batch_size, len(jobs))}/{len(jobs)} trajectories", flush=True)
    return out


def from_program(args, episodes, rows) -> list[tuple[int, list[dict], float, dict]]:
    """Per task family, a program writes the tool call from the generator's metadata; the tool runs it, and the
    answer turn states what it printed (common.core.tasks.tool_program)."""
    from common.core.tasks import tool_program

    out, unknown = [], set()
    for i, row in enumerate(rows):
        code = tool_program(row)
        if code is None:
            unknown.add(row.data_source)
            continue
        call = format_tool_call("python", {"code": code}, episodes.tool_format)  # the template's format

        def turns(messages, call=call):  # first the call; after the tool's result, what it printed as the answer
            if not any(m["role"] == "assistant" for m in messages):
                return call
            printed = re.sub(r"^<(tool_response|output)>|</(tool_response|output)>$", "", messages[-1]["content"])
            return f"<answer>{printed.strip()}</answer>"

        msgs, reward, info = replay(episodes, row, turns)
        out.append((i, msgs, reward, info))
    if unknown:
        print(f"[gen_demos] no program for {sorted(unknown)}: their prompts are skipped")
    return out


def from_file(args, episodes, rows) -> list[tuple[int, list[dict], float, dict]]:
    """Hand-written conversations, replayed: their assistant turns through the environment of their prompt row."""
    out = []
    for r in read_files(args.demos, ["messages"], "--demos"):
        where = f"{r['_file']} row {r['_row']}"
        msgs = r["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise DataError(f"{where}: 'messages' is not a list of {{role, content}}")
        turns = [m.get("content") for m in msgs if m["role"] == "assistant"]
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(f"{where}: no assistant turn, or one with empty content")
        i = int(r.get("prompt_index", r["_row"]))
        if not 0 <= i < len(rows):
            raise DataError(f"{where}: prompt_index {i} is not a row of --prompts ({len(rows)} rows)")
        out.append((i, *replay(episodes, rows[i], turns)))
    return out


def main(args: Args) -> dict:
    if args.source == "file" and not args.demos:
        raise UserError("--source file needs --demos FILE (rows with `messages`)")
    if not args.env.env:
        raise UserError("--env '' : demonstrations go through an environment (--env tools, feedback or file.py:Class)")
    tok = chat.load_tokenizer(args.model)
    rows = load_prompts(args.prompts, tok, max_prompt_length=10_000)
    raw = [r for f in args.prompts for r in read_table(f)]
    if args.num_prompts is not None:
        rows, raw = rows[: args.num_prompts], raw[: args.num_prompts]
    reward = Reward("rule:1.0", max_new_tokens=args.max_new_tokens)
    reward.check({r.data_source for r in rows})
    episodes = episodes_from_args(args.env, tok, reward, "cpu")
    if args.source == "policy":
        tried = from_policy(args, episodes, rows, tok)
        source = f"policy:{args.model}" + (f" prefix:{args.prefix}" if args.prefix else "")
    else:
        tried = from_program(args, episodes, rows) if args.source == "program" else from_file(args, episodes, rows)
        source = args.source
    kept, rejected, seen, per_prompt = [], [], set(), defaultdict(int)
    # a template that renders tools= itself (Qwen, Llama 3.x) was given the schemas: SFT must render them too
    tools_column = {"tools": json.dumps(getattr(episodes.factory(), "tools", []))} if episodes.template_tools else {}
    summary = defaultdict(lambda: defaultdict(float))
    for i, messages, r, info in tried:
        s = summary[rows[i].data_source]
        s["tried"] += 1
        s["tool_used"] += info.get("tool_used", 0.0)
        s["tool_calls"] += info.get("tool_calls", 0.0)
        s["tool_errors"] += info.get("tool_errors", 0.0)
        ran = info.get("tool_calls", 0) > info.get("tool_errors", 0)  # at least one call ran without an error
        why = "reward" if r < args.min_reward else "no tool call ran" if args.require_tool and not ran else ""
        why = why or ("ends without an answer" if messages[-1]["role"] != "assistant" else "")
        if why:
            rejected.append({"messages": messages, "data_source": rows[i].data_source, "reward": r, "why": why})
            continue
        key = (i, tuple(m["content"] for m in messages if m["role"] == "assistant"))
        if key in seen or per_prompt[i] >= args.max_per_prompt:
            s["duplicates" if key in seen else "over_cap"] += 1
            continue
        seen.add(key)
        per_prompt[i] += 1
        s["kept"] += 1
        kept.append(
            {
                "messages": messages,
                "data_source": rows[i].data_source,
                "reward_model": raw[i].get("reward_model") or {"style": "rule", "ground_truth": rows[i].ground_truth},
                "extra_info": {"source": source, "prompt_index": i, "reward": r},
                **tools_column,
            }
        )
    report = {
        src: {
            "prompts": len({i for i, *_ in tried if rows[i].data_source == src}),
            "tried": int(s["tried"]),
            "kept": int(s["kept"]),
            "duplicates": int(s["duplicates"]),
            "over_cap": int(s["over_cap"]),
            "tool_call_rate": s["tool_used"] / max(s["tried"], 1),
            "tool_error_rate": s["tool_errors"] / max(s["tool_calls"], 1),
        }
        for src, s in sorted(summary.items())
    }
    for src, d in report.items():
        print(f"[gen_demos] {src}: {d}")
    for row in kept[: args.show]:
        print("---\n" + "\n".join(f"{m['role']}: {m['content']}" for m in row["messages"][1:]))
    if args.rejected_out and rejected:
        write_rows(rejected, args.rejected_out)
    if args.summary_out:
        with open(args.summary_out, "w") as f:
            json.dump({"source": source, "kept": len(kept), "per_data_source": report}, f, indent=2)
    if not kept:
        raise UserError(
            f"no conversation reached --min-reward {args.min_reward} ({len(tried)} tried): nothing written to {args.out} "
            "(more --k, a --prefix, --source program, or hand-written --demos)"
        )
    write_rows(kept, args.out)
    print(f"[gen_demos] wrote {len(kept)} rows to {args.out}")
    return {"kept": len(kept), "tried": len(tried), "per_data_source": report}


if __name__ == "__main__":
    from common.harness.cli import cli

    torch.set_grad_enabled(False)
    cli(main, Args)  # flags checked, user errors as one line (exit 2)
