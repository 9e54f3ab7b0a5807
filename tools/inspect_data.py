"""The checklist to read before training on a dataset.

    python -m tools.inspect_data data/chain_sum/train.parquet [more files] [--model smollm2-135m-instruct]
    python -m tools.inspect_data data/chain_sum/test.parquet --against data/chain_sum/train.parquet

Prints: rows per file, columns, empty or missing fields, data_source counts, prompt token-length
percentiles (after the chat template), duplicate prompts, and for preference / scored data the
range of the scores. With `--against TRAIN...`: how much of the given (test) files occurs in
the training files, as exact-duplicate prompts and as duplicate problems (`common.core.data.problem_key`:
the same question up to the order of its numbers).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np

from common.core.chat import apply_chat, load_tokenizer
from common.core.data import overlap_report, read_table
from common.core.defaults import DEFAULT_MODEL

SCORE_COLUMNS = ("score", "reward", "chosen_score", "rejected_score")


def _empty(v) -> bool:
    return v is None or (isinstance(v, (str, list, dict)) and len(v) == 0)


def report(
    files: list[str], model: str = DEFAULT_MODEL, prompt_key: str = "prompt", against: list[str] | None = None
) -> dict:
    tok = load_tokenizer(model)
    rows = []
    per_file = {}
    for f in files:
        t = read_table(f)
        per_file[f] = len(t)
        rows += t
    cols = sorted({k for r in rows for k in r})
    empty = {c: sum(_empty(r.get(c)) for r in rows) for c in cols}
    out = {
        "files": per_file,
        "rows": len(rows),
        "columns": cols,
        "empty_or_missing": {c: n for c, n in empty.items() if n},
    }
    if any("data_source" in r for r in rows):
        out["data_source"] = dict(Counter(str(r.get("data_source")) for r in rows).most_common())
    if any(prompt_key in r for r in rows):
        texts = [apply_chat(tok, r[prompt_key]) if not _empty(r.get(prompt_key)) else "" for r in rows]
        lens = np.array([len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts])
        out["prompt_tokens"] = {f"p{q}": int(np.percentile(lens, q)) for q in (0, 50, 90, 99, 100)}
        keys = [json.dumps(r[prompt_key], sort_keys=True, default=str) for r in rows if prompt_key in r]
        out["duplicate_prompts"] = len(keys) - len(set(keys))
    if any("chosen" in r for r in rows):
        out["chosen_equals_rejected"] = sum(r.get("chosen") == r.get("rejected") for r in rows)
    if against:
        train = [r for f in against for r in read_table(f)]
        out["overlap_with_train"] = overlap_report(train, rows, prompt_key)
    for c in SCORE_COLUMNS:
        vals = [float(r[c]) for r in rows if isinstance(r.get(c), (int, float))]
        if vals:
            out[f"{c}_range"] = {"min": min(vals), "mean": float(np.mean(vals)), "max": max(vals)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--model", default=DEFAULT_MODEL, help="tokenizer used for prompt lengths")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument(
        "--against",
        nargs="+",
        default=None,
        metavar="TRAIN",
        help="training files: report test rows whose prompt or problem also occurs there",
    )
    a = p.parse_args()
    from rich.console import Console
    from rich.table import Table

    r = report(a.files, a.model, a.prompt_key, a.against)
    table = Table(title="dataset report", show_header=False)
    for k, v in r.items():
        table.add_row(k, json.dumps(v) if not isinstance(v, (int, str)) else str(v))
    Console().print(table)


if __name__ == "__main__":
    from common.core.errors import UserError, user_error

    try:
        main()
    except UserError as e:
        user_error(f"error: {e}")
