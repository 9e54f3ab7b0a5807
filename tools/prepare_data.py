"""Write prompt datasets in verl's schema.

    python -m tools.prepare_data                                  # built-in reasoning-gym tasks -> data/
    python -m tools.prepare_data --tasks chain_sum countdown --train-size 2000 --test-size 200
    python -m tools.prepare_data --gsm8k openai/gsm8k             # hub (needs internet) or a local file
    python -m tools.prepare_data --math path/to/math.jsonl
    python -m tools.prepare_data --preferences Anthropic/hh-rlhf

Built-in tasks come from reasoning-gym (procedural, offline, seeded), split by problem: a
hash-chosen share of the problems (`--test-fraction`) is test-only, so no test problem, in any
order of its operands, is ever trained on (`python -m tools.inspect_data TEST --against TRAIN`
checks a pair of files). Each writes
`{out}/{task}/train.parquet` and `test.parquet` (prompts), `sft_{train,test}.parquet` (prompt +
correct formatted response, for sft_llm.py) and `pairs_{train,test}.parquet` (right vs wrong
answer, for dpo_llm.py and rm_llm.py); `data_source` is
`reasoning_gym/{task}` and `extra_info["entry"]` keeps the reasoning-gym entry so its own scorer grades.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from common.core.data import read_table, write_rows
from common.core.tasks import ANSWER_INSTRUCTION, TASKS, answer_pairs, sft_rows, write_task
from common.harness.args import Check, PositiveInt


# --------------------------------------------------------------------------------------------- converters
def gsm8k_rows(rows: list[dict], split: str) -> list[dict]:
    """GSM8K (`question`, `answer` ending in `#### N`) -> verl's schema, as verl's gsm8k.py writes."""
    out = []
    for i, r in enumerate(rows):
        m = re.search(r"#### (-?[0-9.,]+)", r["answer"])
        if not m:
            raise ValueError(f"GSM8K row {i}: answer has no '#### N': {r['answer'][-80:]!r}")
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [
                    {
                        "role": "user",
                        "content": r["question"]
                        + ' Let\'s think step by step and output the final answer after "####".',
                    }
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": m.group(1).replace(",", "")},
                "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]},
            }
        )
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
            return s[j + 1 : k]
    return None


def math_rows(rows: list[dict], split: str) -> list[dict]:
    """MATH (`problem`, `solution` with \\boxed{}) -> verl's schema."""
    out = []
    for i, r in enumerate(rows):
        ans = last_boxed(r["solution"])
        if ans is None:
            raise ValueError(f"MATH row {i}: solution has no \\boxed{{}}")
        out.append(
            {
                "data_source": "lighteval/MATH",
                "prompt": [{"role": "user", "content": r["problem"] + " " + ANSWER_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": ans},
                "extra_info": {"split": split, "index": i, "level": r.get("level", ""), "type": r.get("type", "")},
            }
        )
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
        out.append(
            {
                "prompt": r["chosen"][:k].strip(),
                "chosen": r["chosen"][k:].strip(),
                "rejected": r["rejected"][k:].strip(),
            }
        )
    return out


@dataclass
class Args:
    out: str = "data"
    """output folder"""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """built-in reasoning-gym tasks to write (any reasoning-gym dataset name works; TASKS holds tuned difficulty)"""
    train_size: PositiveInt = 2000
    """rows per task in train.parquet"""
    test_size: PositiveInt = 200
    """rows per task in test.parquet"""
    seed: int = 0
    """seed of the stream both splits are drawn from"""
    test_fraction: Annotated[float, Check(gt=0, lt=1)] = 0.25
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

    from common.core.errors import UserError

    out = Path(args.out)
    unknown = [t for t in args.tasks if t not in TASKS and t not in DATASETS]
    if unknown and not (args.gsm8k or args.math or args.preferences):
        raise UserError(
            f"--tasks: unknown reasoning-gym dataset(s) {unknown}; e.g. {', '.join(TASKS)} "
            f"({len(DATASETS)} in reasoning_gym.factory.DATASETS)"
        )
    for task in args.tasks if not (args.gsm8k or args.math or args.preferences) else []:
        train, test = write_task(task, out, args.train_size, args.test_size, args.seed, args.test_fraction)
        for split, src in (("train", train), ("test", test)):  # SFT examples and answer pairs of the same prompts
            write_rows(sft_rows(read_table(str(src))), out / task / f"sft_{split}.parquet")
            write_rows(answer_pairs(read_table(str(src)), args.seed), out / task / f"pairs_{split}.parquet")
        n_train, n_test = len(read_table(str(train))), len(read_table(str(test)))
        print(
            f"wrote {out / task}: train/test.parquet ({n_train}/{n_test} prompts, split by problem), sft_*.parquet, pairs_*.parquet"
        )
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
    from common.harness.cli import cli

    cli(main, Args)  # flags checked, user errors as one line (exit 2)
