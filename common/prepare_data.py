"""Write prompt datasets in verl's schema.

    python -m common.prepare_data                                  # built-in reasoning-gym tasks -> data/
    python -m common.prepare_data --tasks chain_sum countdown --train-size 2000 --test-size 200
    python -m common.prepare_data --gsm8k openai/gsm8k             # hub (needs internet) or a local file
    python -m common.prepare_data --math path/to/math.jsonl
    python -m common.prepare_data --preferences Anthropic/hh-rlhf

Built-in tasks come from reasoning-gym (procedural, offline, seeded), split by problem: a
hash-chosen share of the problems (`--test-fraction`) is test-only, so no test problem, in any
order of its operands, is ever trained on (`python -m common.inspect_data TEST --against TRAIN`
checks a pair of files). Each writes
`{out}/{task}/train.parquet` and `test.parquet` (prompts), `sft_{train,test}.parquet` (prompt +
correct formatted response, for sft_llm.py) and `pairs_{train,test}.parquet` (right vs wrong
answer, for dpo_llm.py and rm_llm.py); `data_source` is
`reasoning_gym/{task}` and `extra_info["entry"]` keeps the reasoning-gym entry so its own scorer grades.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from dataclasses import dataclass, field

from common.data import problem_key, read_table, write_rows

# The one place the answer format is stated. The reward functions read <answer>...</answer>
# (common/rewards.py falls back to the last number when the tags are missing). No example answer:
# "e.g. <answer>42</answer>" made SmolLM2-135M answer 42 to every question.
ANSWER_INSTRUCTION = "Give the final answer inside <answer></answer> tags."

# Built-in tasks: name -> (reasoning-gym dataset, its difficulty settings). Chosen so
# SmolLM2-135M-Instruct solves some but not most (docs/data.md has its greedy accuracy on each).
# basic_arithmetic keeps parentheses on: reasoning-gym 0.1.25 mislabels answers without them.
TASKS = {
    "chain_sum_1d": ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
    "chain_sum": ("chain_sum", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    "basic_arithmetic": ("basic_arithmetic", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    "countdown": ("countdown", dict(min_numbers=3, max_numbers=4, min_target=10, max_target=100)),
    "leg_counting": ("leg_counting", dict(min_animals=1, max_animals=3)),
    "letter_counting": ("letter_counting", dict(min_words=3, max_words=6)),
}
DEFAULT_TASK = "chain_sum_1d"


def _task_row(name: str, e: dict, split: str, index: int) -> dict:
    return {
        "data_source": f"reasoning_gym/{name}",
        "prompt": [{"role": "user", "content": f"{e['question']}\n{ANSWER_INSTRUCTION}"}],
        "ability": "reasoning",
        "reward_model": {"style": "rule", "ground_truth": str(e["answer"])},
        "extra_info": {"split": split, "index": index, "entry": json.dumps(e, default=str)},
    }


def reasoning_gym_rows(task: str, size: int, seed: int, split: str) -> list[dict]:
    """`size` rows of a task drawn with `seed`, unsplit (`split_task_rows` makes the train/test files)."""
    import reasoning_gym

    name, settings = TASKS.get(task, (task, {}))
    return [_task_row(name, e, split, i) for i, e in enumerate(reasoning_gym.create_dataset(name, size=size, seed=seed, **settings))]


def is_test_problem(key: str, test_fraction: float) -> bool:
    """A problem's split, fixed by its hash alone: the same problem lands in the same split whatever
    the seed or sizes, so no test problem is ever trained on."""
    return int(key, 16) % 10_000 < test_fraction * 10_000


def split_task_rows(task: str, train_size: int, test_size: int, seed: int, test_fraction: float = 0.25):
    """(train rows, test rows) of a reasoning-gym task, split by problem (`common.data.problem_key`).

    Entries are drawn from one seeded stream. A hash-chosen `test_fraction` of all problems is
    reserved for test: test keeps each distinct question of those problems once (up to
    `test_size`), train the rest (repeats allowed, as small problem spaces need: chain_sum_1d has
    200 distinct questions). A small problem space can give fewer test rows than asked; the caller
    is told. Before: train and test were drawn with different seeds from the same space, so every
    chain_sum_1d test question also occurred in training."""
    import reasoning_gym

    name, settings = TASKS.get(task, (task, {}))  # any reasoning-gym dataset name works, at its defaults
    max_draws = 50 * (train_size + test_size)
    ds = reasoning_gym.create_dataset(name, size=max_draws, seed=seed, **settings)
    train, test, seen_test = [], [], set()
    for i in range(max_draws):
        if len(train) >= train_size and len(test) >= test_size:
            break
        e = ds[i]
        if is_test_problem(problem_key(e["question"]), test_fraction):
            if len(test) < test_size and e["question"] not in seen_test:
                seen_test.add(e["question"])
                test.append(_task_row(name, e, "test", len(test)))
        elif len(train) < train_size:
            train.append(_task_row(name, e, "train", len(train)))
    return train, test


def write_task(task: str, out: Path, train_size: int, test_size: int, seed: int, test_fraction: float = 0.25,
               log=print) -> tuple[Path, Path]:
    train_rows, test_rows = split_task_rows(task, train_size, test_size, seed, test_fraction)
    if len(test_rows) < test_size or len(train_rows) < train_size:
        log(f"[prepare_data] {task}: {len(train_rows)} train / {len(test_rows)} test rows (asked {train_size} / "
            f"{test_size}): the task has few distinct problems, and test holds only problems never in train")
    train, test = out / task / "train.parquet", out / task / "test.parquet"
    write_rows(train_rows, train)
    write_rows(test_rows, test)
    return train, test


def default_task_files(task: str = DEFAULT_TASK, train_size: int = 2000, test_size: int = 64, seed: int = 0):
    """The built-in task's (train, test) parquet paths, generated once into the cache directory and
    split by problem. Used by every script when no --train-files is given, so `python algos/X.py` always runs."""
    from common.models import cache_dir

    out = cache_dir() / "data" / f"{task}_{train_size}_{test_size}_{seed}_by_problem"
    train, test = out / task / "train.parquet", out / task / "test.parquet"
    if not (train.exists() and test.exists()):
        write_task(task, out, train_size, test_size, seed, log=lambda *a: None)
    return str(train), str(test)


def answer_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Preference pairs from task rows: chosen = the right answer in tags, rejected = a wrong one
    (the right number plus a nonzero offset, or for non-numeric answers another row's answer)."""
    import random

    rng = random.Random(seed)
    out = []
    for i, r in enumerate(rows):
        gt = r["reward_model"]["ground_truth"]
        try:
            wrong = str(int(gt) + rng.choice([-3, -2, -1, 1, 2, 3]))
        except ValueError:
            wrong = rows[(i + 1) % len(rows)]["reward_model"]["ground_truth"]
            if wrong == gt:
                continue
        out.append({"prompt": r["prompt"], "chosen": f"<answer>{gt}</answer>", "rejected": f"<answer>{wrong}</answer>",
                    "data_source": r["data_source"]})
    return out


def sft_rows(rows: list[dict]) -> list[dict]:
    """SFT examples from task rows: the prompt, and a short correct, well-formatted answer built
    from reasoning-gym's own solution (the expression when the task gives one, then the tags)."""
    out = []
    for r in rows:
        entry = json.loads(r["extra_info"]["entry"])
        gt = r["reward_model"]["ground_truth"]
        expr = entry.get("metadata", {}).get("expression")
        response = (f"{expr} = {gt}\n" if expr and expr != gt else "") + f"<answer>{gt}</answer>"
        out.append({"prompt": r["prompt"], "response": response, "data_source": r["data_source"]})
    return out


def default_sft_files(task: str = DEFAULT_TASK, train_size: int = 2000, test_size: int = 64, seed: int = 0):
    """(train, test) SFT parquet paths built from the built-in task (`sft_rows`), cached."""
    train_src, test_src = default_task_files(task, train_size, test_size, seed)
    out = Path(train_src).parent
    train, test = out / "sft_train.parquet", out / "sft_test.parquet"
    if not (train.exists() and test.exists()):
        write_rows(sft_rows(read_table(train_src)), train)
        write_rows(sft_rows(read_table(test_src)), test)
    return str(train), str(test)


def default_preference_files(task: str = DEFAULT_TASK, train_size: int = 2000, test_size: int = 64, seed: int = 0):
    """(train, test) preference parquet paths built from the built-in task (`answer_pairs`), cached."""
    train_src, test_src = default_task_files(task, train_size, test_size, seed)
    out = Path(train_src).parent
    train, test = out / "pairs_train.parquet", out / "pairs_test.parquet"
    if not (train.exists() and test.exists()):
        write_rows(answer_pairs(read_table(train_src), seed), train)
        write_rows(answer_pairs(read_table(test_src), seed + 1), test)
    return str(train), str(test)


# --------------------------------------------------------------------------------------------- converters
def gsm8k_rows(rows: list[dict], split: str) -> list[dict]:
    """GSM8K (`question`, `answer` ending in `#### N`) -> verl's schema, as verl's gsm8k.py writes."""
    out = []
    for i, r in enumerate(rows):
        m = re.search(r"#### (-?[0-9.,]+)", r["answer"])
        if not m:
            raise ValueError(f"GSM8K row {i}: answer has no '#### N': {r['answer'][-80:]!r}")
        out.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": r["question"] + ' Let\'s think step by step and output the final answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": m.group(1).replace(",", "")},
            "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]},
        })
    return out


def last_boxed(s: str) -> str | None:
    """Content of the last \\boxed{...} in s (balanced braces)."""
    i = s.rfind("\\boxed{")
    if i < 0:
        return None
    depth, j = 0, i + len("\\boxed")
    for k in range(j, len(s)):
        depth += {"{": 1, "}": -1}.get(s[k], 0)
        if depth == 0:
            return s[j + 1:k]
    return None


def math_rows(rows: list[dict], split: str) -> list[dict]:
    """MATH (`problem`, `solution` with \\boxed{}) -> verl's schema."""
    out = []
    for i, r in enumerate(rows):
        ans = last_boxed(r["solution"])
        if ans is None:
            raise ValueError(f"MATH row {i}: solution has no \\boxed{{}}")
        out.append({
            "data_source": "lighteval/MATH",
            "prompt": [{"role": "user", "content": r["problem"] + " " + ANSWER_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ans},
            "extra_info": {"split": split, "index": i, "level": r.get("level", ""), "type": r.get("type", "")},
        })
    return out


def preference_rows(rows: list[dict]) -> list[dict]:
    """Preference sets -> {prompt, chosen, rejected}. Accepts that schema already, or hh-rlhf style
    full transcripts ("\\n\\nHuman: ... \\n\\nAssistant: ...") split at the last Assistant turn."""
    out = []
    for i, r in enumerate(rows):
        if "prompt" in r:
            out.append({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]})
            continue
        k = r["chosen"].rfind("\n\nAssistant:") + len("\n\nAssistant:")
        if k < len("\n\nAssistant:") or r["chosen"][:k] != r["rejected"][:k]:
            raise ValueError(f"preference row {i}: cannot find a shared prompt in chosen/rejected")
        out.append({"prompt": r["chosen"][:k].strip(), "chosen": r["chosen"][k:].strip(), "rejected": r["rejected"][k:].strip()})
    return out


@dataclass
class Args:
    out: str = "data"
    """output folder"""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """built-in reasoning-gym tasks to write (any reasoning-gym dataset name works; TASKS holds tuned difficulty)"""
    train_size: int = 2000
    """rows per task in train.parquet"""
    test_size: int = 200
    """rows per task in test.parquet"""
    seed: int = 0
    """seed of the stream both splits are drawn from"""
    test_fraction: float = 0.25
    """share of a task's problems reserved for test (split by problem, never by seed alone)"""
    gsm8k: str | None = None
    """GSM8K source: hub id (e.g. openai/gsm8k, config 'main') or a local jsonl/parquet with question, answer"""
    math: str | None = None
    """MATH source: hub id or local file with problem, solution"""
    preferences: str | None = None
    """preference source: hub id or local file (prompt/chosen/rejected, or hh-rlhf transcripts)"""


def _read_source(src: str, split: str) -> list[dict]:
    if Path(src).exists():
        return read_table(src)
    import datasets

    name, _, config = src.partition(":")
    return list(datasets.load_dataset(name, config or ("main" if "gsm8k" in name else None), split=split))


def main(args: Args) -> None:
    from reasoning_gym.factory import DATASETS

    from common.run import UserError

    out = Path(args.out)
    unknown = [t for t in args.tasks if t not in TASKS and t not in DATASETS]
    if unknown and not (args.gsm8k or args.math or args.preferences):
        raise UserError(f"--tasks: unknown reasoning-gym dataset(s) {unknown}; e.g. {', '.join(TASKS)} "
                        f"({len(DATASETS)} in reasoning_gym.factory.DATASETS)")
    if not 0 < args.test_fraction < 1:
        raise UserError(f"--test-fraction {args.test_fraction}: must be in (0, 1)")
    for task in args.tasks if not (args.gsm8k or args.math or args.preferences) else []:
        train, test = write_task(task, out, args.train_size, args.test_size, args.seed, args.test_fraction)
        for split, src in (("train", train), ("test", test)):  # SFT examples and answer pairs of the same prompts
            write_rows(sft_rows(read_table(str(src))), out / task / f"sft_{split}.parquet")
            write_rows(answer_pairs(read_table(str(src)), args.seed), out / task / f"pairs_{split}.parquet")
        n_train, n_test = len(read_table(str(train))), len(read_table(str(test)))
        print(f"wrote {out / task}: train/test.parquet ({n_train}/{n_test} prompts, split by problem), sft_*.parquet, pairs_*.parquet")
    for src, conv, name in ((args.gsm8k, gsm8k_rows, "gsm8k"), (args.math, math_rows, "math")):
        if src:
            for split in ("train", "test"):
                rows = conv(_read_source(src, split), split) if not Path(src).exists() or split == "train" else None
                if rows:
                    write_rows(rows, out / name / f"{split}.parquet")
                    print(f"wrote {out / name / f'{split}.parquet'} ({len(rows)} rows)")
    if args.preferences:
        rows = preference_rows(_read_source(args.preferences, "train"))
        write_rows(rows, out / "preferences" / "train.parquet")
        print(f"wrote {out / 'preferences' / 'train.parquet'} ({len(rows)} rows)")


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    from common.run import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
