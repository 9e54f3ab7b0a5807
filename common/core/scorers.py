"""Rewards: verl's `compute_score` signature, a registry by `data_source`, and weighted mixes.

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict

A dict holds `score` plus extra fields that get logged (we use `acc`: exact-match accuracy, which
`eval/accuracy` reports; `score` may give partial credit). `compute_score` below is the dispatcher
(verl's `default_compute_score`); `--reward-fn file.py:fn` replaces it for every row.

`Reward` combines sources by weight, `--reward "rule:1.0,model:0.5,length:0.1"`:
    rule    the dispatcher (or --reward-fn)         per data_source
    model   a sequence-classification reward model  (--reward-model PATH; scored with its own tokenizer)
    format  1 if the response has <answer>...</answer>, else 0
    length  -(response tokens / max_new_tokens): a length penalty in [-1, 0]
    length_bonus  +(response tokens / max_new_tokens): a bounded length bonus in [0, 1]

Several custom functions, as TRL's reward_funcs + reward_weights: `--reward-fn a.py:f1 --reward-fn
b.py:f2 --reward-weights 0.6 0.4` makes `rule` their weighted sum, each logged as `reward/<f>`.
The seed's fusion 0.6 RM + 0.3 length bonus + 0.1 keyword penalty is one command:
`--reward-model RM --reward "model:0.6,length_bonus:0.3,rule:0.1" --reward-fn keyword_penalty.py:score`.
"""

from __future__ import annotations

import json
import re

from common.core.errors import UserError, load_from_file

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_tag_answer(text: str) -> str | None:
    """The content of the last <answer>...</answer> in `text`, stripped; None when absent."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str, ground_truth) -> str | None:
    """The answer a response gives: the <answer> tag content when present; otherwise, for a
    numeric ground truth, the last number in the text (small models rarely keep the tag format:
    SmolLM2-135M never did on chain_sum, so a tags-only reward would be all zeros); else None.
    The `format` reward term rewards the tags themselves."""
    tagged = extract_tag_answer(text)
    if tagged is not None:
        return tagged
    if ground_truth is not None and NUMBER_RE.fullmatch(str(ground_truth).strip()):
        nums = NUMBER_RE.findall(text)
        return nums[-1] if nums else None
    return None


# ---------------------------------------------------------------------------------------------
# Scorers
# ---------------------------------------------------------------------------------------------
def reasoning_gym_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None) -> dict:
    """reasoning-gym's own scorer on the answer (`extract_answer`). `extra_info["entry"]` holds the
    task's entry (question, answer, metadata) as JSON, written by `python -m tools.prepare_data`.
    score: the task's `score_answer` (may give partial credit: "11" for "1" scores 0.5);
    acc: 1 only when that score is 1 (exact)."""
    import reasoning_gym

    task = data_source.split("/", 1)[1]
    entry = (
        json.loads(extra_info["entry"])
        if extra_info and "entry" in extra_info
        else {"answer": str(ground_truth), "metadata": {}}
    )
    answer = extract_answer(solution_str, entry.get("answer", ground_truth))
    score = 0.0 if answer is None else float(reasoning_gym.get_score_answer_fn(task)(answer, entry))
    return {"score": score, "acc": float(score == 1.0)}


def _normalize_number(s: str) -> str:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        f = float(s)
        return str(int(f)) if f == int(f) else str(f)
    except ValueError:
        return s


def gsm8k_score(data_source: str, solution_str: str, ground_truth, extra_info=None, mode: str = "strict") -> dict:
    """GSM8K: strict takes the number after the last `#### `; flexible the last number in the text."""
    if mode == "strict":
        found = re.findall(r"#### (-?[0-9.,$]+)", solution_str)
    else:
        found = re.findall(r"-?[0-9][0-9.,]*", solution_str)
    ok = bool(found) and _normalize_number(found[-1]) == _normalize_number(str(ground_truth))
    return {"score": float(ok), "acc": float(ok)}


def math_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Math answers checked with math-verify (boxed or plain LaTeX, equivalent forms accepted)."""
    from math_verify import parse, verify

    gold = parse(f"${ground_truth}$" if "\\boxed" not in str(ground_truth) else str(ground_truth))
    tagged = extract_tag_answer(solution_str)
    pred = parse(f"${tagged}$" if tagged is not None else solution_str)
    ok = bool(gold) and bool(pred) and verify(gold, pred)
    return {"score": float(ok), "acc": float(ok)}


def format_score(solution_str: str) -> float:
    return float(extract_tag_answer(solution_str) is not None)


def match_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """Exact match of the <answer> content (or the whole stripped response) with ground_truth."""
    ans = extract_tag_answer(solution_str)
    ok = (ans if ans is not None else solution_str.strip()) == str(ground_truth).strip()
    return {"score": float(ok), "acc": float(ok)}


def environment_score(data_source, solution_str, ground_truth, extra_info=None):
    """Rows of a hub environment (--env textarena:GAME, openenv:URL; common.integrations.hub_envs): the environment
    scores them; a one-turn answer outside it scores 0."""
    return {"score": 0.0, "acc": 0.0}


# data_source -> scorer. Prefix entries end with "/" and match every data_source under them.
REGISTRY = {
    "reasoning_gym/": reasoning_gym_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "math": math_score,
    "match": match_score,
    "textarena/": environment_score,
    "openenv/": environment_score,
}


def find_scorer(data_source: str):
    if data_source in REGISTRY:
        return REGISTRY[data_source]
    for key, fn in REGISTRY.items():
        if key.endswith("/") and data_source.startswith(key):
            return fn
    return None


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """The dispatcher: the registry's scorer for `data_source` (verl's default_compute_score)."""
    fn = find_scorer(data_source)
    if fn is None:
        raise KeyError(f"no reward function for data_source {data_source!r}")
    return fn(data_source, solution_str, ground_truth, extra_info)


def check_data_sources(sources) -> None:
    """At start-up: every data_source has a scorer, or an error listing the known ones."""
    unknown = sorted({s for s in sources if find_scorer(s) is None})
    if unknown:
        raise UserError(
            f"unknown data_source {unknown}; known: {sorted(REGISTRY)} (or pass --reward-fn path/to/file.py:fn)"
        )


def load_reward_fn(spec: str):
    """`path/to/file.py:fn` -> the function (the file is imported only when asked; errors name --reward-fn)."""
    fn = load_from_file(spec, "--reward-fn", "function")
    if not callable(fn):
        raise UserError(f"--reward-fn {spec!r}: {spec.rpartition(':')[0]} has no function {spec.rpartition(':')[2]!r}")
    return fn
