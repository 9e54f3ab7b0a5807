"""The built-in tasks: reasoning-gym datasets as prompt files in verl's schema, split by problem.

A library module (the training scripts' defaults and `python -m tools.prepare_data` both use it):
a hash-chosen share of each task's problems (`test_fraction`) is test-only, so no test problem, in
any order of its operands, is ever trained on. `default_task_files()` generates a task once into
the cache; `sft_rows` / `answer_pairs` turn its rows into SFT examples and preference pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.core.data import load_prompts, problem_key, read_table, write_rows

# The one place the answer format is stated. The reward functions read <answer>...</answer>
# (common/core/rewards.py falls back to the last number when the tags are missing). No example answer:
# "e.g. <answer>42</answer>" made SmolLM2-135M answer 42 to every question.
ANSWER_INSTRUCTION = "Give the final answer inside <answer></answer> tags."

# Built-in tasks: name -> (reasoning-gym dataset, its difficulty settings). Chosen so
# SmolLM2-135M-Instruct solves some but not most (docs/data.md has its greedy accuracy on each).
# basic_arithmetic keeps parentheses on: reasoning-gym 0.1.25 mislabels answers without them.
TASKS = {
    "chain_sum_1d": ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
    "chain_sum": ("chain_sum", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    "basic_arithmetic": ("basic_arithmetic", dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)),
    # +, -, *, / of two one-digit (possibly negative) numbers: a second task in SmolLM2-135M's learnable band
    "basic_arithmetic_1d": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
    "countdown": ("countdown", dict(min_numbers=3, max_numbers=4, min_target=10, max_target=100)),
    "leg_counting": ("leg_counting", dict(min_animals=1, max_animals=3)),
    "letter_counting": ("letter_counting", dict(min_words=3, max_words=6)),
    # number theory, several steps (factor, find the gcd, divide): issue 34's multi-step task. 64 new tokens cut
    # none of SmolLM2-135M's answers (median 16 tokens); its greedy accuracy is 0.17.
    "lcm": ("lcm", dict(min_numbers=2, max_numbers=2, min_value=2, max_value=20)),
    # tool tasks (docs/agents.md, "Teach the tool"): computation SmolLM2-135M cannot do in its head, a one-line
    # program can. Trained on the first three; the last two are held out of demonstrations and RL (transfer).
    "products_3d": ("products", dict(min_terms=2, max_terms=2, min_digits=3, max_digits=3)),
    "gcd_3d": ("gcd", dict(min_numbers=2, max_numbers=2, min_value=100, max_value=999)),
    "count_bits": ("count_bits", dict(min_n=1000, max_n=65536)),
    "chain_sum_4d": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=4, max_digits=4)),
    "lcm_2d": ("lcm", dict(min_numbers=2, max_numbers=2, min_value=10, max_value=99)),
}
TOOL_TASKS_TRAINED, TOOL_TASKS_HELD_OUT = ("products_3d", "gcd_3d", "count_bits"), ("chain_sum_4d", "lcm_2d")
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
    return [
        _task_row(name, e, split, i)
        for i, e in enumerate(reasoning_gym.create_dataset(name, size=size, seed=seed, **settings))
    ]


def is_test_problem(key: str, test_fraction: float) -> bool:
    """A problem's split, fixed by its hash alone: the same problem lands in the same split whatever
    the seed or sizes, so no test problem is ever trained on."""
    return int(key, 16) % 10_000 < test_fraction * 10_000


def split_task_rows(task: str, train_size: int, test_size: int, seed: int, test_fraction: float = 0.25):
    """(train rows, test rows) of a reasoning-gym task, split by problem (`common.core.data.problem_key`).

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


def write_task(
    task: str, out: Path, train_size: int, test_size: int, seed: int, test_fraction: float = 0.25, log=print
) -> tuple[Path, Path]:
    train_rows, test_rows = split_task_rows(task, train_size, test_size, seed, test_fraction)
    if len(test_rows) < test_size or len(train_rows) < train_size:
        log(
            f"[prepare_data] {task}: {len(train_rows)} train / {len(test_rows)} test rows (asked {train_size} / "
            f"{test_size}): the task has few distinct problems, and test holds only problems never in train"
        )
    train, test = out / task / "train.parquet", out / task / "test.parquet"
    write_rows(train_rows, train)
    write_rows(test_rows, test)
    return train, test


def default_task_files(task: str = DEFAULT_TASK, train_size: int = 2000, test_size: int = 64, seed: int = 0):
    """The built-in task's (train, test) parquet paths, generated once into the cache directory and
    split by problem. Used by every script when no --train-files is given, so `python algos/X.py` always runs."""
    from common.core.defaults import cache_dir

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
        out.append(
            {
                "prompt": r["prompt"],
                "chosen": f"<answer>{gt}</answer>",
                "rejected": f"<answer>{wrong}</answer>",
                "data_source": r["data_source"],
            }
        )
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


def tool_program(row) -> str | None:
    """A Python program that prints the answer of a reasoning-gym row, written from the generator's own metadata
    (tools.gen_demos --source program: demonstrations of the tool without a bigger model), or None for a family
    without a writer. row: a PromptRow (its extra_info holds the generator's entry)."""
    entry = row.extra_info.get("entry")
    meta = json.loads(entry).get("metadata", {}) if isinstance(entry, str) else {}
    family = row.data_source.removeprefix("reasoning_gym/")
    if family in ("products", "chain_sum", "basic_arithmetic") and meta.get("expression"):
        return f"print({meta['expression']})"
    if family in ("gcd", "lcm") and meta.get("numbers"):
        return f"import math\nprint(math.{family}({', '.join(map(str, meta['numbers']))}))"
    if family == "count_bits" and "number" in meta:
        return f"print(bin({meta['number']}).count('1'))"
    return None


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


HUB_PREFIXES = ("textarena:", "openenv:", "verifiers:")  # --env of an environment hub (common.integrations.hub_envs)
ENV_TEST_SEED0 = 1_000_000  # a hub environment's held-out games: seeds from here (train seeds count up from 0)


def is_hub_spec(spec: str) -> bool:
    return bool(spec) and spec.startswith(HUB_PREFIXES)


def data_source(spec: str) -> str:
    kind, _, name = spec.partition(":")
    return f"{kind}/{Path(name).name if kind == 'openenv' and not name.startswith('http') else name}"


def env_rows(spec: str, n: int, split: str) -> list[dict]:
    """`n` seed rows of a hub environment (prompt: a label; the environment writes the first message): train seeds
    0..n-1, test seeds ENV_TEST_SEED0.. (never trained on)."""
    base = 0 if split == "train" else ENV_TEST_SEED0
    src = data_source(spec)
    return [{"prompt": f"{src} seed {base + i}", "data_source": src, "extra_info": {"seed": base + i}}
            for i in range(n)]  # fmt: skip


def default_env_files(spec: str, train_size: int = 2000, test_size: int = 64) -> tuple[str, str]:
    """A hub environment's (train, test) seed rows (`env_rows`: test seeds never trained on), written
    once into the cache: what a script reads with --env textarena:GAME / openenv:URL and no --train-files."""
    from common.core.defaults import cache_dir

    out = cache_dir() / "data" / "env" / data_source(spec).replace("/", "__")
    train, test = out / f"train_{train_size}.parquet", out / f"test_{test_size}.parquet"
    if not (train.exists() and test.exists()):
        write_rows(env_rows(spec, train_size, "train"), train)
        write_rows(env_rows(spec, test_size, "test"), test)
    return str(train), str(test)


def load_rl_prompts(data, tok, reward, log, env: str = "") -> tuple[list, list]:
    """The prompts of an RL script's PromptArgs `data` (common.harness.args): --train-files / --val-files, or the
    built-in
    --task (its problem-split train and test files, common.core.tasks) when --train-files is not given; validation rows
    cut to --num-eval-prompts. Every data_source must have a reward function (`reward.check`, before any
    model trains), and the first prompt is printed as the model sees it. Returns (train_rows, val_rows)."""
    train_files, val_files = data.train_files, data.val_files
    if train_files is None:  # a hub --env brings its own games (seeds), else the built-in --task
        train_files, default_val = default_env_files(env) if is_hub_spec(env) else default_task_files(data.task)
        val_files = val_files or [default_val]
    load = lambda files: load_prompts(
        files, tok, data.prompt_key, data.reward_fn_key, data.max_prompt_length, data.truncate_prompts, log
    )
    train_rows = load(train_files)
    val_rows = load(val_files)[: data.num_eval_prompts] if val_files else []
    reward.check({r.data_source for r in train_rows + val_rows})
    log(f"[prompt] the first training prompt as the model sees it:\n{train_rows[0].text}")
    return train_rows, val_rows
