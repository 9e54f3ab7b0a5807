"""Side-by-side evaluation of several models or checkpoints on the same prompts.

    python -m common.evaluate --models smollm2-135m-instruct runs/ppo_llm__.../checkpoints/step_100/policy \\
        --data data/chain_sum/test.parquet --out eval.md

Greedy answers by default (`--samples k --temperature t` for sampled answers). Prints reward and
exact-match accuracy per model and per data_source, and writes a markdown file showing each
prompt with every model's answer. A checkpoint folder holding a LoRA adapter loads its base model.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import tyro

from common import models as M
from common.data import load_prompts
from common.rewards import Reward
from common.rollout import generate, sample_seed, tokenize_queries


def load_any(path: str, tok):
    """A causal LM folder, or a peft adapter folder (its base model + the adapter, merged)."""
    cfg = Path(path) / "adapter_config.json"
    if cfg.exists():
        from peft import PeftModel

        base = M.load_causal_lm(json.loads(cfg.read_text())["base_model_name_or_path"], tok)
        return PeftModel.from_pretrained(base, path).merge_and_unload()
    return M.load_causal_lm(path, tok)


@torch.no_grad()
def answer(model, tok, rows, max_new_tokens: int, batch_size: int = 16, samples: int = 1, temperature: float = 1.0,
           seed: int = 0, with_lengths: bool = False):
    """responses[i][k]: the k-th answer to rows[i] (greedy when temperature == 0). With
    `with_lengths`, also lengths[i][k] (response tokens) and is_eos[i][k] (ended with EOS), which
    the `length` and `model` reward terms need."""
    device = next(model.parameters()).device
    out, lengths, eos = [[] for _ in rows], [[] for _ in rows], [[] for _ in rows]
    for k in range(samples):
        for i in range(0, len(rows), batch_size):
            batch = rows[i:i + batch_size]
            q, qm = tokenize_queries(tok, [r.text for r in batch], device)
            seeds = None if temperature == 0 else [sample_seed(seed, k, r.uid) for r in batch]
            ro = generate(model, tok, q, qm, max_new_tokens, max(temperature, 1e-5), seeds=seeds)
            n, e = ro.response_mask.sum(1).tolist(), ro.is_eos.tolist()
            for j, text in enumerate(tok.batch_decode(ro.responses, skip_special_tokens=True)):
                out[i + j].append(text)
                lengths[i + j].append(n[j])
                eos[i + j].append(e[j])
    return (out, lengths, eos) if with_lengths else out


def score(rows, responses: list[list[str]], reward: Reward, lengths=None, is_eos=None) -> dict:
    """Mean reward and accuracy overall and per data_source (over all k samples)."""
    per = defaultdict(lambda: {"reward": [], "accuracy": []})
    for k in range(len(responses[0])):
        texts = [r[k] for r in responses]
        lens = torch.tensor([n[k] for n in lengths]) if lengths else torch.ones(len(rows))
        s, _, extra = reward(rows, texts, lens, is_eos=[e[k] for e in is_eos] if is_eos else None)
        acc = extra.get("acc", (s >= 1).float())
        for row, sv, av in zip(rows, s.tolist(), acc.tolist()):
            for key in ("all", row.data_source):
                per[key]["reward"].append(sv)
                per[key]["accuracy"].append(av)
    return {k: {m: sum(v) / len(v) for m, v in d.items()} | {"n": len(d["reward"])} for k, d in per.items()}


@torch.no_grad()
def evaluate_policy(accelerator, policy, tok, reward: Reward, rows, max_new_tokens: int, batch_size: int):
    """Validation inside training: greedy answers to `rows`, split across processes.
    Returns ({eval/reward, eval/accuracy} as global means, this rank's samples). Accuracy is exact
    match (the reward's `acc` field, else score >= 1), never partial credit."""
    from common.rollout import unwrap_for_generation

    world = accelerator.num_processes
    rows = rows[:max(len(rows) // world, 1) * world]  # equal shares, so the gather below lines up
    local = rows[accelerator.process_index::world]
    scores, accs, samples = [], [], []
    with unwrap_for_generation(accelerator, policy) as model:
        for i in range(0, len(local), batch_size):
            batch = local[i:i + batch_size]
            q, qm = tokenize_queries(tok, [x.text for x in batch], accelerator.device)
            ro = generate(model, tok, q, qm, max_new_tokens)
            texts = tok.batch_decode(ro.responses, skip_special_tokens=True)
            s, _, extra = reward(batch, texts, ro.response_mask.sum(1), accelerator.device, ro.is_eos)
            scores.append(s)
            accs.append(extra.get("acc", (s >= 1).float()))
            samples += [{"prompt": x.text, "response": t, "reward": float(v)} for x, t, v in zip(batch, texts, s)]
    scores, accs = accelerator.gather(torch.cat(scores)), accelerator.gather(torch.cat(accs))
    return {"eval/reward": scores.mean().item(), "eval/accuracy": accs.mean().item()}, samples


@dataclass
class Args:
    models: list[str] = field(default_factory=lambda: [M.DEFAULT_MODEL])
    """models or checkpoint folders to compare"""
    data: list[str] = field(default_factory=list)
    """prompt files (verl schema); default: the built-in task's test split"""
    num_prompts: int = 64
    """prompts evaluated (the first N)"""
    max_new_tokens: int = 64
    """answer length limit"""
    samples: int = 1
    """answers per prompt"""
    temperature: float = 0.0
    """0: greedy"""
    reward: str = "rule:1.0"
    """reward sources (as in the training scripts)"""
    reward_fn: Optional[str] = None
    """custom reward function path.py:fn"""
    batch_size: int = 16
    """prompts per generate call"""
    out: Optional[str] = None
    """markdown file with every model's answer per prompt"""
    json_out: Optional[str] = None
    """write the scores as JSON here"""


def main(args: Args) -> dict:
    from common.prepare_data import default_task_files

    tok = M.load_tokenizer(args.models[0])
    data = args.data or [default_task_files()[1]]
    rows = load_prompts(data, tok, max_prompt_length=10_000)[:args.num_prompts]
    reward = Reward(args.reward, args.reward_fn, max_new_tokens=args.max_new_tokens)
    reward.check({r.data_source for r in rows})
    results, answers = {}, {}
    for name in args.models:
        model = load_any(M.resolve_model_path(name), M.load_tokenizer(name) if Path(M.resolve_model_path(name), "tokenizer_config.json").exists() else tok).eval()
        answers[name], lengths, is_eos = answer(model, tok, rows, args.max_new_tokens, args.batch_size, args.samples,
                                                args.temperature, with_lengths=True)
        results[name] = score(rows, answers[name], reward, lengths, is_eos)
        del model
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(rows)} prompts from {', '.join(data)}")
    for col in ("model", "data_source", "reward", "accuracy", "n"):
        table.add_column(col)
    for name, res in results.items():
        for src, d in res.items():
            table.add_row(name, src, f"{d['reward']:.3f}", f"{d['accuracy']:.3f}", str(d["n"]))
    Console().print(table)
    if args.out:
        lines = [f"# Side by side: {len(rows)} prompts\n"]
        for i, row in enumerate(rows):
            lines.append(f"## Prompt {i} ({row.data_source}, answer: {row.ground_truth})\n\n```\n{row.text}\n```\n")
            for name in args.models:
                lines.append(f"**{name}**\n\n```\n{answers[name][i][0]}\n```\n")
        Path(args.out).write_text("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
