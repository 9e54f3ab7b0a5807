"""Loaders (parquet, jsonl, arrow, several files, verl's schema), bad input messages, sampler, tools."""

import json

import pytest

from common.core import chat as M
from common.core.data import DataError, Sampler, load_preferences, load_prompts, load_sft, write_rows
from common.core.scorers import compute_score
from common.core.tasks import reasoning_gym_rows
from tools.prepare_data import gsm8k_rows, last_boxed, math_rows, preference_rows


@pytest.fixture(scope="module")
def tok(tiny):
    return M.load_tokenizer(tiny)


def verl_gsm8k_rows():
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py writes them."""
    raw = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "What is 1,000 + 250?", "answer": "#### 1,250"},
    ]
    return gsm8k_rows(raw, "train")


def test_verl_gsm8k_parquet_scores(tmp_path, tok):
    path = tmp_path / "gsm8k.parquet"
    write_rows(verl_gsm8k_rows(), path)
    rows = load_prompts([str(path)], tok)
    assert [r.data_source for r in rows] == ["openai/gsm8k"] * 2
    assert rows[1].ground_truth == "1250" and "<|im_start|>user" in rows[0].text
    assert compute_score(rows[0].data_source, "so 3+4=7\n#### 7", rows[0].ground_truth, rows[0].extra_info) == {
        "score": 1.0,
        "acc": 1.0,
    }
    assert compute_score(rows[1].data_source, "#### 1,250", rows[1].ground_truth)["score"] == 1.0
    assert (
        compute_score(rows[0].data_source, "the answer is 7", rows[0].ground_truth)["score"] == 0.0
    )  # strict needs ####


def test_formats_and_merge(tmp_path, tok):
    rows = reasoning_gym_rows("chain_sum", 6, 0, "train")
    write_rows(rows[:3], tmp_path / "a.parquet")
    write_rows(rows[3:], tmp_path / "b.jsonl")
    import datasets

    ds = datasets.Dataset.from_list(rows[:2])
    ds.save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    merged = load_prompts([str(tmp_path / "a.parquet"), str(tmp_path / "b.jsonl")], tok)
    assert len(merged) == 6 and [r.uid for r in merged] == list(range(6))
    assert merged[4].ground_truth == rows[4]["reward_model"]["ground_truth"]
    assert len(load_prompts([str(arrow)], tok)) == 2
    assert len(load_prompts([str(tmp_path / "saved")], tok)) == 2
    # a plain pyarrow IPC stream with a .arrow suffix (what verl users hit) loads too
    import pyarrow as pa

    table = pa.Table.from_pylist([{"prompt": "2+2?", "data_source": "match"}])
    with pa.OSFile(str(tmp_path / "s.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    assert load_prompts([str(tmp_path / "s.arrow")], tok)[0].data_source == "match"


def test_prompt_key_renaming_and_length_filter(tmp_path, tok):
    path = tmp_path / "r.jsonl"
    write_rows([{"question": "short", "src": "match"}, {"question": "long " * 300, "src": "match"}], path)
    logs = []
    rows = load_prompts(
        [str(path)], tok, prompt_key="question", reward_fn_key="src", max_prompt_length=64, log=logs.append
    )
    assert len(rows) == 1 and "dropped 1 of 2" in logs[0]
    cut = load_prompts(
        [str(path)], tok, prompt_key="question", reward_fn_key="src", max_prompt_length=64, truncate=True
    )
    assert len(cut) == 2 and len(tok(cut[1].text, add_special_tokens=False)["input_ids"]) <= 66


def test_bad_inputs_have_clear_messages(tmp_path, tok):
    with pytest.raises(DataError, match="missing.parquet: file not found"):
        load_prompts([str(tmp_path / "missing.parquet")], tok)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_prompts([str(tmp_path / "empty.jsonl")], tok)
    write_rows([{"text": "x", "data_source": "match"}], tmp_path / "nocol.jsonl")
    with pytest.raises(
        DataError, match=r"column\(s\) \['prompt'\] missing; columns present: \['data_source', 'text'\]"
    ):
        load_prompts([str(tmp_path / "nocol.jsonl")], tok)
    write_rows([{"prompt": 5, "data_source": "match"}], tmp_path / "badprompt.jsonl")
    with pytest.raises(DataError, match="badprompt.jsonl row 0 column 'prompt': expected a string or a list"):
        load_prompts([str(tmp_path / "badprompt.jsonl")], tok)
    write_rows([{"prompt": "a", "data_source": "match", "extra": 1}], tmp_path / "other.jsonl")
    write_rows([{"prompt": "a", "data_source": "match"}], tmp_path / "one.jsonl")
    with pytest.raises(DataError, match="different columns"):
        load_prompts([str(tmp_path / "one.jsonl"), str(tmp_path / "other.jsonl")], tok)
    with pytest.raises(DataError, match="unsupported format"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompts([str(tmp_path / "x.csv")], tok)


def test_preferences_and_sft(tmp_path, tok):
    write_rows(
        [
            {"prompt": "q1", "chosen": "good", "rejected": "bad"},
            {"prompt": "q2", "chosen": "same", "rejected": "same"},
            {
                "prompt": [{"role": "user", "content": "q3"}],
                "chosen": [{"role": "assistant", "content": "c"}],
                "rejected": [{"role": "assistant", "content": "r"}],
            },
        ],
        tmp_path / "p.jsonl",
    )
    logs = []
    rows = load_preferences([str(tmp_path / "p.jsonl")], tok, log=logs.append)
    assert len(rows) == 2 and "chosen == rejected" in logs[0]
    assert rows[1]["chosen"] == "c" and rows[1]["prompt"].endswith("assistant\n")
    # TRL's implicit-prompt conversational format
    conv = [{"role": "user", "content": "q"}]
    write_rows(
        [
            {
                "chosen": conv + [{"role": "assistant", "content": "y"}],
                "rejected": conv + [{"role": "assistant", "content": "n"}],
            }
        ],
        tmp_path / "implicit.jsonl",
    )
    r = load_preferences([str(tmp_path / "implicit.jsonl")], tok)[0]
    assert (r["chosen"], r["rejected"]) == ("y", "n") and "q<|im_end|>" in r["prompt"]
    # SFT rows: the prompt's ids, then the response's and EOS, the loss mask on the last two
    from common.core.chat import apply_chat

    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    write_rows([{"messages": conv + [{"role": "assistant", "content": "a"}]}], tmp_path / "sft.jsonl")
    r = load_sft([str(tmp_path / "sft.jsonl")], tok)[0]
    p = enc(apply_chat(tok, conv))
    assert r["ids"] == p + enc("a") + [tok.eos_token_id] and r["loss_mask"] == [0] * len(p) + [1, 1]
    write_rows([{"prompt": "p", "response": "r"}], tmp_path / "sft2.jsonl")
    r = load_sft([str(tmp_path / "sft2.jsonl")], tok)[0]
    p = enc(apply_chat(tok, "p"))
    assert r["ids"] == p + enc("r") + [tok.eos_token_id] and r["loss_mask"] == [0] * len(p) + [1, 1]


def test_sampler_is_deterministic_and_resumable():
    a = Sampler(10, seed=3)
    first = a.take(7) + a.take(7)  # crosses an epoch
    assert sorted(first[:10]) == list(range(10))
    b = Sampler(10, seed=3)
    b.take(7)
    state = b.state_dict()
    c = Sampler(10, seed=3)
    c.load_state_dict(state)
    assert c.take(7) == first[7:]
    assert Sampler(10, seed=4).take(10) != Sampler(10, seed=3).take(10)


def test_converters():
    assert last_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    m = math_rows([{"problem": "1/2?", "solution": r"\boxed{\frac12}", "level": "Level 1", "type": "x"}], "test")
    assert m[0]["reward_model"]["ground_truth"] == r"\frac12"
    p = preference_rows(
        [{"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}]
    )
    assert p[0] == {"prompt": "Human: hi\n\nAssistant:", "chosen": "hello", "rejected": "go away"}
    with pytest.raises(ValueError, match="no '#### N'"):
        gsm8k_rows([{"question": "q", "answer": "7"}], "train")


def test_bad_rows_and_files_are_named(tmp_path, tiny):
    from common.core.chat import load_tokenizer
    from common.core.data import DataError, load_prompts, load_sft, read_table

    tok = load_tokenizer(tiny)
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "data_source": "x"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="latin1.jsonl: cannot be read"):
        read_table(str(tmp_path / "latin1.jsonl"))
    rows = [{"prompt": "ok", "data_source": "x"}, {"prompt": "  ", "data_source": "x"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"p.jsonl row 1 column 'prompt': empty text"):
        load_prompts([str(tmp_path / "p.jsonl")], tok)
    rows = [{"prompt": [{"role": "user", "content": ""}], "data_source": "x"}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"m.jsonl row 0 .*message 0 \(user\) has empty"):
        load_prompts([str(tmp_path / "m.jsonl")], tok)
    rows = [{"prompt": "q", "response": "a"}, {"prompt": "q2", "response": None}]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"s.jsonl row 1 column 'response'"):
        load_sft([str(tmp_path / "s.jsonl")], tok)
