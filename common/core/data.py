"""Datasets: prompt files in verl's schema, preference pairs, SFT examples, and a resumable sampler.

Prompt rows (verl's schema, so verl's preprocessed parquet files work unchanged):
    prompt        list of {role, content} messages, or a string
    data_source   string: picks the reward function (common/core/rewards.py)
    reward_model  {style, ground_truth}
    extra_info    dict (split, index, task payload)
Files: .parquet, .jsonl / .json, .arrow (a `datasets` Arrow file or a save_to_disk folder), or a
hub dataset id (`name` or `name:split`). Several files are merged in order; their columns must agree.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.core.chat import apply_chat, turn_end_id
from common.core.errors import UserError
from common.core.seeds import mix_seed

FORMATS = (".parquet", ".jsonl", ".json", ".arrow")


class DataError(UserError):
    """Bad input data; the message names the file, row or column (a UserError: one line, exit 2)."""


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------
def read_table(path: str) -> list[dict]:
    """All rows of one file (or hub dataset) as a list of dicts."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path)
    suffix = p.suffix.lower()
    if not p.exists():
        # a hub id is "org/name" (or a legacy "name"), without a file extension ("train.parq" is a mistyped file)
        if suffix[1:].isalpha() or path.startswith((".", "/", "~")) or path.count("/") >= 2:
            other = "" if suffix in FORMATS or not suffix[1:].isalpha() else f" (and {suffix} is not one of {FORMATS})"
            raise DataError(f"{path}: file not found{other}")
        name, _, split = path.partition(":")  # a hub id, for users with internet
        return list(datasets.load_dataset(name, split=split or "train"))
    try:
        return _read_local(p, suffix, path, datasets)
    except DataError:
        raise
    except Exception as e:  # non-UTF-8 text, a truncated parquet, a JSON syntax error...
        raise DataError(
            f"{path}: cannot be read as {suffix or 'a dataset folder'} ({type(e).__name__}: {str(e)[:200]})"
        ) from None


def _read_local(p: Path, suffix: str, path: str, datasets) -> list[dict]:
    if p.is_dir():
        ds = datasets.load_from_disk(str(p))
    elif suffix == ".parquet":
        ds = datasets.Dataset.from_parquet(str(p))
    elif suffix in (".jsonl", ".json"):
        if p.stat().st_size == 0:
            raise DataError(f"{path}: file is empty")
        ds = datasets.Dataset.from_json(str(p))
    elif suffix == ".arrow":
        try:
            ds = datasets.Dataset.from_file(str(p))
        except Exception:  # an Arrow IPC stream written by pyarrow rather than by `datasets`
            import pyarrow as pa

            with pa.OSFile(str(p)) as f:
                ds = datasets.Dataset(pa.ipc.open_stream(f).read_all())
    else:
        raise DataError(f"{path}: unsupported format {suffix!r}; use one of {', '.join(FORMATS)}")
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"]
    return _rows_of(ds, path)


def _rows_of(ds, path) -> list[dict]:
    if len(ds) == 0:
        raise DataError(f"{path}: file is empty (0 rows)")
    return list(ds)


def read_files(files: list[str] | str, required: list[str], what: str = "--train-files") -> list[dict]:
    """Rows of several files merged in order; each row gets `_file` and `_row` for error messages.
    Raises DataError for a missing column (naming it and those present) or a schema mismatch."""
    files = [files] if isinstance(files, str) else list(files)
    if not files:
        raise DataError(f"{what}: no files given")
    rows, schemas = [], {}
    for f in files:
        table = read_table(f)
        cols = set(table[0].keys())
        missing = [c for c in required if c not in cols]
        if missing:
            hint = (
                " (or name them with --prompt-key / --reward-fn-key)"
                if {"prompt", "data_source"} & set(missing)
                else ""
            )
            raise DataError(f"{f}: column(s) {missing} missing; columns present: {sorted(cols)}{hint}")
        schemas[f] = cols
        rows.extend({**r, "_file": f, "_row": i} for i, r in enumerate(table))
    if len({frozenset(s) for s in schemas.values()}) > 1:
        desc = "; ".join(f"{f}: {sorted(s)}" for f, s in schemas.items())
        raise DataError(f"{what}: files have different columns: {desc}")
    return rows


def _check_messages(x, where: str):
    """A prompt or conversation as a string or a list of {role, content}; empty ones are an error naming the row."""
    if isinstance(x, str):
        if not x.strip():
            raise DataError(f"{where}: empty text")
        return x
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, dict) and "role" in m and "content" in m for m in x):
        for i, m in enumerate(x):
            if not isinstance(m["content"], str) or not m["content"].strip():
                raise DataError(f"{where}: message {i} ({m['role']}) has empty or non-text content: {m['content']!r}")
        return [{"role": m["role"], "content": m["content"]} for m in x]
    raise DataError(
        f"{where}: expected a string or a list of {{role, content}} messages, got {type(x).__name__}: {str(x)[:80]}"
    )


# ---------------------------------------------------------------------------------------------
# Prompt datasets (RL)
# ---------------------------------------------------------------------------------------------
@dataclass
class PromptRow:
    text: str  # the prompt after the chat template: what the policy sees
    data_source: str
    ground_truth: object
    extra_info: dict = field(default_factory=dict)
    uid: int = 0  # position in the merged dataset
    messages: object = (
        None  # the prompt before any template (string or messages): a reward model renders it with its own
    )


def load_prompts(
    files,
    tok,
    prompt_key: str = "prompt",
    reward_fn_key: str = "data_source",
    max_prompt_length: int = 512,
    truncate: bool = False,
    log=print,
) -> list[PromptRow]:
    """Prompt rows, chat-templated. Prompts longer than `max_prompt_length` tokens are dropped
    (with a logged count), or cut to their last `max_prompt_length` tokens with `truncate`."""
    rows = read_files(files, [prompt_key, reward_fn_key])
    out, dropped = [], 0
    for r in rows:
        where = f"{r['_file']} row {r['_row']} column '{prompt_key}'"
        messages = _check_messages(r[prompt_key], where)
        text = apply_chat(tok, messages)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        if n > max_prompt_length:
            if not truncate:
                dropped += 1
                continue
            ids = tok(text, add_special_tokens=False)["input_ids"][-max_prompt_length:]
            text = tok.decode(ids)
        rm = r.get("reward_model") or {}
        extra = r.get("extra_info") or {}
        out.append(
            PromptRow(
                text,
                str(r[reward_fn_key]),
                rm.get("ground_truth") if isinstance(rm, dict) else rm,
                dict(extra) if isinstance(extra, dict) else {"value": extra},
                len(out),
                messages,
            )
        )
    if dropped:
        log(f"[data] dropped {dropped} of {len(rows)} prompts longer than --max-prompt-length {max_prompt_length}")
    if not out:
        raise DataError(f"{files}: no prompts left after dropping those over --max-prompt-length {max_prompt_length}")
    return out


# ---------------------------------------------------------------------------------------------
# Problems: what "held out" compares
# ---------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def problem_key(prompt) -> str:
    """The canonical problem of a prompt (string or messages), as a short hash: the text with every
    number replaced by `#`, plus the numbers sorted. So "3 + 5 =" and "5 + 3 =" are one problem
    (and, conservatively, so are "5 - 3" and "3 - 5"): a test problem is then never trained on in
    any order of its operands. Over-merging only makes splits stricter."""
    text = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)
    text = " ".join(text.split())
    numbers = sorted(float(x) for x in _NUMBER.findall(text))
    return hashlib.sha1(json.dumps([_NUMBER.sub("#", text), numbers]).encode()).hexdigest()[:16]


def overlap_report(train_rows: list[dict], test_rows: list[dict], prompt_key: str = "prompt") -> dict:
    """How much of a test set occurs in a training set: exact-duplicate prompts and duplicate problems
    (`problem_key`), as counts of test rows and of distinct test problems."""
    exact = {json.dumps(r.get(prompt_key), sort_keys=True, default=str) for r in train_rows}
    train_problems = {problem_key(r[prompt_key]) for r in train_rows if r.get(prompt_key) is not None}
    test_keys = [problem_key(r[prompt_key]) for r in test_rows if r.get(prompt_key) is not None]
    return {
        "test_rows": len(test_rows),
        "test_rows_with_prompt_in_train": sum(
            json.dumps(r.get(prompt_key), sort_keys=True, default=str) in exact for r in test_rows
        ),
        "test_rows_with_problem_in_train": sum(k in train_problems for k in test_keys),
        "distinct_test_problems": len(set(test_keys)),
        "distinct_test_problems_in_train": len(set(test_keys) & train_problems),
    }


# ---------------------------------------------------------------------------------------------
# Prompt + response as one sequence (SFT, reward model training and scoring, DPO)
# ---------------------------------------------------------------------------------------------
def encode_prompt_response(
    tok,
    prompts: list[str],
    responses: list,
    eos=True,
    max_length: int | None = None,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + response (+ EOS)` token sequences, the one encoder of the project.

    prompts: templated prompt texts. responses: texts, or token-id lists (a rollout's own ids,
    taken as they are: they already hold the EOS the policy emitted, so nothing is appended).
    eos: per response (or one bool for all): append EOS after a text response. A reward model
    is trained on `prompt + chosen + EOS` and reads its score at the last real token, so the RL
    reward scorer must pass eos=True exactly for responses that ended with EOS.
    Truncation, in this order: response (EOS included) to its first `max_completion_length`
    tokens (a cut response loses its EOS: the policy never emitted one there); prompt to its last
    `max_prompt_length`; then, past `max_length`, the prompt's start is cut, then the response's end.
    Prompt and response are tokenized separately (as the policy sees them: prompt ids, then response ids).

    Returns input_ids, attention_mask, response_mask: (N, L) each, L = the longest sequence.
    Naive: `ids = tok(prompt).input_ids + tok(response).input_ids + [eos]` per row, padded right."""
    eos = [eos] * len(prompts) if isinstance(eos, bool) else list(eos)
    seqs, response_masks = [], []
    for prompt, response, add_eos in zip(prompts, responses, eos):
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        if isinstance(response, str):
            c = tok(response, add_special_tokens=False)["input_ids"] + ([turn_end_id(tok)] if add_eos else [])
        else:
            c = [int(t) for t in response]
        if max_completion_length is not None:
            c = c[:max_completion_length]
        if max_prompt_length is not None:
            p = p[len(p) - min(len(p), max_prompt_length) :]
        if max_length is not None:
            p = p[len(p) - min(len(p), max(0, max_length - len(c))) :]
            c = c[:max_length]
        seqs.append(p + c)
        response_masks.append([0] * len(p) + [1] * len(c))
    L = max(map(len, seqs))
    ids = torch.tensor([x + [tok.pad_token_id] * (L - len(x)) for x in seqs], device=device, dtype=torch.long)  # (N, L)
    attn = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs], device=device, dtype=torch.long)  # (N, L)
    response_mask = torch.tensor(
        [m + [0] * (L - len(m)) for m in response_masks], device=device, dtype=torch.float
    )  # (N, L)
    return ids, attn, response_mask


# ---------------------------------------------------------------------------------------------
# Preference and SFT datasets
# ---------------------------------------------------------------------------------------------
def _as_response(x, where: str) -> str:
    """A response as text: a string, or the content of assistant messages (TRL's conversational format)."""
    if isinstance(x, str):  # an empty response is a legitimate (rejected) answer
        return x
    x = _check_messages(x, where)
    return "".join(m["content"] for m in x if m["role"] == "assistant") or x[-1]["content"]


def load_preferences(files, tok, log=print) -> list[dict]:
    """Rows {prompt (templated text), chosen, rejected} (response texts, no EOS added).
    A prompt may be missing when chosen/rejected are full conversations (TRL's implicit prompt):
    then the prompt is their shared leading messages. Rows with chosen == rejected are dropped with a warning."""
    rows = read_files(files, ["chosen", "rejected"])
    out, same = [], 0
    for r in rows:
        where = f"{r['_file']} row {r['_row']}"
        chosen, rejected = r["chosen"], r["rejected"]
        prompt = r.get("prompt")
        if prompt is None:
            if not isinstance(chosen, list):
                raise DataError(f"{where}: no 'prompt' column and 'chosen' is not a message list")
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        c = _as_response(chosen, where + " column 'chosen'")
        j = _as_response(rejected, where + " column 'rejected'")
        if c == j:
            same += 1
            continue
        out.append(
            {"prompt": apply_chat(tok, _check_messages(prompt, where + " column 'prompt'")), "chosen": c, "rejected": j}
        )
    if same:
        log(f"[data] warning: dropped {same} preference rows whose chosen == rejected")
    if not out:
        raise DataError(f"{files}: no usable preference rows")
    return out


def load_sft(files, tok) -> list[dict]:
    """Rows {prompt (templated text of the messages before the first assistant turn), ids, loss_mask} (lists of
    equal length; `encode_conversation`): from `messages` (a whole conversation: the loss covers every assistant
    turn, nothing else; an optional `tools` column of JSON schemas for templates that render tools=) or from
    `prompt` + `response` columns (one assistant turn)."""
    first = read_table(files[0] if isinstance(files, list) else files)[0]
    out = []
    if "messages" in first:
        for r in read_files(files, ["messages"]):
            where = f"{r['_file']} row {r['_row']} column 'messages'"
            msgs = _check_messages(r["messages"], where)
            if isinstance(msgs, str) or msgs[-1]["role"] != "assistant":
                raise DataError(f"{r['_file']} row {r['_row']}: 'messages' must end with an assistant turn")
            if msgs[0]["role"] == "assistant":
                raise DataError(f"{where}: the conversation starts with an assistant turn (no prompt before it)")
            tools = r.get("tools") or None
            if isinstance(tools, str):  # verl's multi-turn SFT files may hold the schemas as a JSON string
                tools = json.loads(tools)
            ids, mask = encode_conversation(tok, msgs, tools)
            out.append({"prompt": _prompt_text(tok, msgs, tools), "ids": ids, "loss_mask": mask})
        return out
    for r in read_files(files, ["prompt", "response"]):
        prompt = _check_messages(r["prompt"], f"{r['_file']} row {r['_row']} column 'prompt'")
        response = _check_messages(r["response"], f"{r['_file']} row {r['_row']} column 'response'")
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if isinstance(response, str):
            msgs = msgs + [{"role": "assistant", "content": response}]
        else:
            msgs = msgs + [m for m in response]
        ids, mask = encode_conversation(tok, msgs, prompt_text=apply_chat(tok, prompt))
        out.append({"prompt": apply_chat(tok, prompt), "ids": ids, "loss_mask": mask})
    return out


# ---------------------------------------------------------------------------------------------
# Conversations: the one rendering rule of multi-turn rollouts (common/core/envs.py) and multi-turn SFT
# ---------------------------------------------------------------------------------------------
def turn_glue(tok) -> str:
    """What the template writes after an assistant turn's end token (e.g. '\\n' after <|im_end|>): turn_end_id's."""
    eos = tok.convert_ids_to_tokens(turn_end_id(tok))
    text = apply_chat(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
    return text[text.rindex(eos) + len(eos) :] if eos and eos in text else ""


def observation_ids(tok, messages: list[dict], glue: str | None = None) -> list[int]:
    """The tokens that follow a model turn (ended by EOS) when `messages` (tool results, feedback) come next,
    through the generation prompt of the next assistant turn: the template's rendering of a conversation with and
    without them, the difference, tokenized alone (after the glue the template writes after EOS). Never a
    re-rendering of the conversation itself, so earlier turns keep the ids they were sampled as."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = apply_chat(tok, base, add_generation_prompt=False)
    after = apply_chat(tok, base + list(messages), add_generation_prompt=True)
    if not after.startswith(before):
        raise UserError("the chat template renders earlier turns differently once an observation follows them")
    glue = turn_glue(tok) if glue is None else glue
    return tok(glue + after[len(before) :], add_special_tokens=False)["input_ids"]


def _prompt_text(tok, messages: list[dict], tools=None) -> str:
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return apply_chat(tok, messages[:first], tools=tools)


def encode_conversation(tok, messages: list[dict], tools=None, prompt_text: str | None = None):
    """A conversation as the token ids a multi-turn rollout of it produces, and its loss mask: (ids, mask), lists.

    The rule (the same as `common.core.envs.Episodes.run`): the messages before the first assistant turn rendered by
    the chat template with the generation prompt (with `tools=` where given); each assistant turn its content
    tokenized alone plus EOS (what the policy samples: the template's own assistant header is already in the
    preceding generation prompt); the messages between two assistant turns as `observation_ids`. Mask 1 on
    assistant tokens and their EOS, 0 on everything else (system, user, tool messages: context). A rollout's turn
    sampled as non-canonical tokens (a rare split of the same text) is encoded here canonically.
    Naive: for a one-turn conversation, tok(apply_chat(prompt)) + tok(response) + [eos], mask on the last two."""
    if prompt_text is None:
        prompt_text = _prompt_text(tok, messages, tools)
    ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    glue, pending = None, []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            glue = turn_glue(tok) if glue is None else glue
            obs = observation_ids(tok, pending, glue)
            ids, mask, pending = ids + obs, mask + [0] * len(obs), []
        turn = tok(m["content"], add_special_tokens=False)["input_ids"] + [turn_end_id(tok)]
        ids, mask = ids + turn, mask + [1] * len(turn)
    return ids, mask


# ---------------------------------------------------------------------------------------------
# A deterministic, resumable sampler
# ---------------------------------------------------------------------------------------------
class Sampler:
    """Endless stream of dataset indices: a fresh permutation per epoch, seeded by (seed, epoch).

    `state_dict()` is (epoch, position), so a resumed run draws exactly the batches it would have."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            m = min(k - len(out), self.n - self.pos)
            out += self._perm[self.pos : self.pos + m]
            self.pos += m
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = s["epoch"], s["pos"]
        self._perm = self._permutation()


def write_rows(rows: list[dict], path: str | Path) -> None:
    """Write rows to .parquet or .jsonl (by extension); atomic (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a temp name of this process's own: two ranks generating the same default task at once must not
    # rename each other's half-written file
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if path.suffix == ".parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(tmp, index=False)
    elif path.suffix == ".jsonl":
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    else:
        raise DataError(f"{path}: write .parquet or .jsonl")
    os.replace(tmp, path)
