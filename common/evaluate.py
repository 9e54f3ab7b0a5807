"""Side-by-side evaluation of several models or checkpoints on the same prompts.

    python -m common.evaluate --models smollm2-135m-instruct runs/ppo_llm__.../checkpoints/step_100/policy \\
        --data data/chain_sum/test.parquet --out eval.md

Greedy answers by default (`--samples k --temperature t` for sampled answers). Prints reward and
exact-match accuracy per model and per data_source, and writes a markdown file showing each
prompt with every model's answer. `--n K` adds K sampled answers per prompt and reports pass@1,
pass@k (unbiased estimator) and maj@K (majority vote over the extracted answers) next to the greedy
accuracy. Any checkpoint folder is a model (a LoRA adapter is merged onto its base).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

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


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k).
    Naive: the fraction of all k-subsets of the n samples that hold at least one correct one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(texts: list[str], correct: list[float], ground_truth) -> float:
    """maj@k: the most frequent extracted answer among the samples (ties: the first seen), scored by
    one sample that gave it. Samples with no extractable answer do not vote."""
    from common.rewards import extract_answer

    answers = [extract_answer(t, ground_truth) for t in texts]
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    best = max(votes, key=lambda a: (votes[a], -answers.index(a)))
    return float(correct[answers.index(best)])


def sampled_metrics(rows, responses: list[list[str]], reward: Reward, lengths, is_eos) -> dict:
    """pass@1, pass@k (k = powers of 2 up to n, and n) and maj@n per data_source, from n samples per prompt."""
    n = len(responses[0])
    correct = [[0.0] * n for _ in rows]
    for k in range(n):
        s, _, extra = reward(rows, [r[k] for r in responses], torch.tensor([x[k] for x in lengths]),
                             is_eos=[e[k] for e in is_eos])
        for i, a in enumerate(extra.get("acc", (s >= 1).float()).tolist()):
            correct[i][k] = a
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128) if k <= n} | {n})
    per = defaultdict(lambda: defaultdict(list))
    for row, texts, c in zip(rows, responses, correct):
        for key in ("all", row.data_source):
            for k in ks:
                per[key][f"pass@{k}"].append(pass_at_k(n, int(sum(c)), k))
            per[key][f"maj@{n}"].append(majority_correct(texts, c, row.ground_truth))
    return {key: {m: sum(v) / len(v) for m, v in d.items()} for key, d in per.items()}


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
    sources = sorted({x.data_source for x in rows})  # the same list on every rank
    src_ids = accelerator.gather(torch.tensor([sources.index(x.data_source) for x in local], device=accelerator.device))
    scores, accs = accelerator.gather(torch.cat(scores)), accelerator.gather(torch.cat(accs))
    metrics = {"eval/reward": scores.mean().item(), "eval/accuracy": accs.mean().item()}
    for i, src in enumerate(sources if len(sources) > 1 else []):  # validation mixing tasks: accuracy per data_source
        metrics[f"eval/accuracy/{src}"] = accs[src_ids == i].mean().item()
    return metrics, samples


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
    n: int = 0
    """K > 1: also sample K answers per prompt at --sample-temperature and report pass@k (unbiased) and maj@K"""
    sample_temperature: float = 1.0
    """temperature of the --n samples"""
    reward: str = "rule:1.0"
    """reward sources (as in the training scripts)"""
    reward_fn: Optional[list[str]] = None
    """path/to/file.py:fn replacing the data_source registry for every row; repeat for several (summed with --reward-weights)"""
    reward_weights: Optional[list[float]] = None
    """weights of the --reward-fn functions, in order (default: 1 each); each is logged as reward/<fn>"""
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
    reward = Reward(args.reward, args.reward_fn, max_new_tokens=args.max_new_tokens, reward_weights=args.reward_weights)
    reward.check({r.data_source for r in rows})
    results, answers = {}, {}
    for name in args.models:
        model = load_any(M.resolve_model_path(name), M.load_tokenizer(name) if Path(M.resolve_model_path(name), "tokenizer_config.json").exists() else tok).eval()
        answers[name], lengths, is_eos = answer(model, tok, rows, args.max_new_tokens, args.batch_size, args.samples,
                                                args.temperature, with_lengths=True)
        results[name] = score(rows, answers[name], reward, lengths, is_eos)
        if args.n > 1:
            sampled, s_lengths, s_eos = answer(model, tok, rows, args.max_new_tokens, args.batch_size, args.n,
                                               args.sample_temperature, seed=1, with_lengths=True)
            for src, d in sampled_metrics(rows, sampled, reward, s_lengths, s_eos).items():
                results[name][src].update(d)
        del model
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(rows)} prompts from {', '.join(data)}")
    extra_cols = [k for k in next(iter(results.values()))["all"] if k.startswith(("pass@", "maj@"))]
    for col in ("model", "data_source", "reward", "accuracy", *extra_cols, "n"):
        table.add_column(col)
    for name, res in results.items():
        for src, d in res.items():
            table.add_row(name, src, f"{d['reward']:.3f}", f"{d['accuracy']:.3f}", *(f"{d[c]:.3f}" for c in extra_cols), str(d["n"]))
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
    from common.run import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
