"""Answering and scoring prompts: greedy or sampled answers, exact-match accuracy, pass@k and maj@k.

A library module: training scripts validate with `evaluate_policy`, and the tools
(`python -m tools.evaluate`, `python -m tools.gen_preferences`) answer with `answer`.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import torch

from common.core import models as M
from common.core.generation import generate, tokenize_queries
from common.core.rewards import Reward
from common.core.seeds import mix_seed
from common.parallel.sharded import unwrap_for_generation


def load_any(path: str, tok):
    """A causal LM folder, or a peft adapter folder (its base model + the adapter, merged)."""
    cfg = Path(path) / "adapter_config.json"
    if cfg.exists():
        from peft import PeftModel

        base = M.load_causal_lm(json.loads(cfg.read_text())["base_model_name_or_path"], tok)
        return PeftModel.from_pretrained(base, path).merge_and_unload()
    return M.load_causal_lm(path, tok)


@torch.no_grad()
def answer(
    model,
    tok,
    rows,
    max_new_tokens: int,
    batch_size: int = 16,
    samples: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    with_lengths: bool = False,
    engine=None,
):
    """responses[i][k]: the k-th answer to rows[i] (greedy when temperature == 0), from `model` or through
    `engine` (a VLLMEngine, synced from `model`). With
    `with_lengths`, also lengths[i][k] (response tokens) and is_eos[i][k] (ended with EOS), which
    the `length` and `model` reward terms need."""
    device = next(model.parameters()).device
    out, lengths, eos = [[] for _ in rows], [[] for _ in rows], [[] for _ in rows]
    for k in range(samples):
        for i in range(0, len(rows), batch_size):
            batch = rows[i : i + batch_size]
            q, qm = tokenize_queries(tok, [r.text for r in batch], device)
            seeds = None if temperature == 0 else [mix_seed(seed, k, r.uid) for r in batch]
            rollout = generate(model, tok, q, qm, max_new_tokens, max(temperature, 1e-5), seeds=seeds, engine=engine)
            n, e = rollout.response_mask.sum(1).tolist(), rollout.is_eos.tolist()
            for j, text in enumerate(tok.batch_decode(rollout.responses, skip_special_tokens=True)):
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
    from common.core.scorers import extract_answer

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
        s, _, extra = reward(
            rows, [r[k] for r in responses], torch.tensor([x[k] for x in lengths]), is_eos=[e[k] for e in is_eos]
        )
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
def evaluate_policy(accelerator, policy, tok, reward: Reward, rows, max_new_tokens: int, batch_size: int, engine=None,
                    episodes=None):  # fmt: skip
    """Validation inside training: greedy answers to `rows`, split across processes (through `engine`,
    the vLLM engine of --rollout-engine vllm, when given); with `episodes` (--env), greedy trajectories through the
    environment, scored by it (eval/env/<key>: its counts, e.g. win, turns, tool_calls, per trajectory).
    Returns ({eval/reward, eval/accuracy} as global means, this rank's samples). Accuracy is exact
    match (the reward's `acc` field, else score >= 1), never partial credit."""
    world = accelerator.num_processes
    rows = rows[: max(len(rows) // world, 1) * world]  # equal shares, so the gather below lines up
    local = rows[accelerator.process_index :: world]
    scores, accs, samples, counts = [], [], [], {}
    with unwrap_for_generation(accelerator, policy, engine) as model:
        for i in range(0, len(local), batch_size):
            batch = local[i : i + batch_size]
            if episodes is not None:  # through the environment: its reward, its counts
                ro = episodes.run(model, batch, None, engine, max_new_tokens)
                scores.append(ro.scores)
                accs.append((ro.scores >= 1).float())
                for k, v in ro.stats.items():
                    counts.setdefault(k, []).append(v.float())
                samples += [{"prompt": x.text, "response": t, "reward": float(v)}
                            for x, t, v in zip(batch, ro.transcripts, ro.scores)]  # fmt: skip
                continue
            q, qm = tokenize_queries(tok, [x.text for x in batch], accelerator.device)
            rollout = generate(model, tok, q, qm, max_new_tokens, engine=engine)
            texts = tok.batch_decode(rollout.responses, skip_special_tokens=True)
            s, _, extra = reward(batch, texts, rollout.response_mask.sum(1), accelerator.device, rollout.is_eos)
            scores.append(s)
            accs.append(extra.get("acc", (s >= 1).float()))
            samples += [{"prompt": x.text, "response": t, "reward": float(v)} for x, t, v in zip(batch, texts, s)]
    sources = sorted({x.data_source for x in rows})  # the same list on every rank
    src_ids = accelerator.gather(torch.tensor([sources.index(x.data_source) for x in local], device=accelerator.device))
    scores, accs = accelerator.gather(torch.cat(scores)), accelerator.gather(torch.cat(accs))
    metrics = {"eval/reward": scores.mean().item(), "eval/accuracy": accs.mean().item()}
    metrics |= {f"eval/{k}": accelerator.gather(torch.cat(v)).mean().item() for k, v in sorted(counts.items())
                if k.startswith("env/")}  # fmt: skip
    for i, src in enumerate(sources if len(sources) > 1 else []):  # validation mixing tasks: accuracy per data_source
        metrics[f"eval/accuracy/{src}"] = accs[src_ids == i].mean().item()
    return metrics, samples
