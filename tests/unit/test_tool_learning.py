"""Teaching the tool (docs/agents.md, "Teach the tool"): multi-turn SFT renders a conversation exactly as a rollout of
it is rendered (ids and loss mask), demonstrations from the policy, from programs and by hand (rejection, schema,
duplicates, the cap), the forced prefix, the rates of tool learning, and the chain from checkpoint folders."""

import json
import sys
from functools import partial

import pytest
import sft_llm as S  # noqa: E402
import torch

from common.core import chat
from common.core import models as M
from common.core.data import PromptRow, encode_conversation, load_sft, read_table, write_rows
from common.core.envs import Episodes, tool_metrics
from common.integrations.builtin_envs import ToolEnv
from conftest import REPO
from shared_envs import ScriptedEngine, StoppingEngine, _rows, _score
from shared_tool_learning import _gen_demos

sys.path.insert(0, str(REPO / "algos"))

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def _trajectories(tok, model, reply, n=2, prefix=""):
    engine = ScriptedEngine(tok, reply)
    eps = Episodes(partial(ToolEnv, ("calculator",)), tok, _score, max_turns=3, max_tokens=200, timeout=10)
    return eps.run(model, _rows(n), seeds=list(range(n)), engine=engine, prefix=prefix), engine


# a template that renders tools= itself (as Qwen's and Llama 3.x's do): the tool schemas in a system block, results
# in "tool" messages
TOOLS_TEMPLATE = (  # Hermes-style (resolve_tool_format: hermes): calls in <tool_call>, results in <tool_response>
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}"
    "</tool_response>{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("template", ["smollm2", "think_dropping", "tools"])
def test_multi_turn_sft_ids_equal_the_rollouts_ids_and_its_mask_the_response_mask(tiny, tmp_path, template):
    """A trajectory of the rollout loop (two model turns, a tool result between them), written as an SFT row (as
    tools.gen_demos writes it) and loaded the way sft_llm.py loads it: the same ids, and the loss mask on the
    prompt-less part equals response_mask; with SmolLM2's template, one that drops past <think> blocks, and one that
    renders tools= itself."""
    from shared_envs import THINK_DROPPING_TEMPLATE

    tok = chat.load_tokenizer(tiny)
    tok.chat_template = {"smollm2": tok.chat_template, "think_dropping": THINK_DROPPING_TEMPLATE}.get(
        template, TOOLS_TEMPLATE
    )
    model = M.load_causal_lm(tiny, tok)
    reply = lambda ctx: (
        "<think>so</think>The answer is 42." if "<tool_response>42" in ctx else f"<think>hm</think>{CALL}"
    )
    ro, _ = _trajectories(tok, model, reply)
    assert ro.stats["env/turns"].tolist() == [2, 2]
    tools = {"tools": json.dumps(ToolEnv(("calculator",)).tools)} if template == "tools" else {}
    assert ("tool" in [m["role"] for m in ro.messages[0]]) == (template == "tools")
    write_rows([{"messages": m, **tools} for m in ro.messages], tmp_path / "sft.jsonl")
    rows = load_sft([str(tmp_path / "sft.jsonl")], tok)
    for i, row in enumerate(rows):
        q = ro.queries[i][ro.query_mask[i].bool()].tolist()  # (P_i,) the prompt as the sampler saw it
        n = int((ro.responses[i] != tok.pad_token_id).sum())  # real ids after the prompt (pad is never sampled here)
        assert row["ids"] == q + ro.responses[i, :n].tolist()
        assert row["loss_mask"] == [0] * len(q) + ro.response_mask[i, :n].int().tolist()
        assert sum(row["loss_mask"]) == int(ro.response_mask[i].sum()) > 0
    # the script's encoder pads them and keeps the mask; its loss counts exactly the model's tokens
    ids, attn, loss_mask = S.encode_examples(tok, rows, 512, "cpu")  # (2, L) each
    assert (
        loss_mask.sum() == ro.response_mask.sum() and (attn.sum(1) == torch.tensor([len(r["ids"]) for r in rows])).all()
    )
    s, count = S.sft_loss_sum(model, ids, attn, loss_mask)
    assert count == loss_mask[:, 1:].sum() and torch.isfinite(s)


def test_code_protocol_sft_ids_equal_the_rollouts_ids(tiny, tmp_path):
    """--tool-format code: a turn stopped at </code> (the template's turn end appended by the rollout), written as an
    SFT row and loaded as sft_llm.py loads it: the same ids, the loss mask equal to response_mask (the appended turn
    end trained, as the template renders it after the assistant's content)."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    reply = lambda ctx: "The answer is 42." if "<output>42" in ctx else "<code>\nprint(6 * 7)\n</code> trailing words"
    eps = Episodes(partial(ToolEnv, ("python",)), tok, _score, max_turns=3, max_tokens=200, timeout=10,
                   tool_format="code")  # fmt: skip
    ro = eps.run(model, _rows(2), seeds=[0, 1], engine=StoppingEngine(tok, reply))
    assert ro.stats["env/turns"].tolist() == [2, 2] and ro.scores.tolist() == [1.0, 1.0]
    write_rows([{"messages": m} for m in ro.messages], tmp_path / "sft.jsonl")
    rows = load_sft([str(tmp_path / "sft.jsonl")], tok)
    for i, row in enumerate(rows):
        q = ro.queries[i][ro.query_mask[i].bool()].tolist()
        n = int((ro.responses[i] != tok.pad_token_id).sum())
        assert row["ids"] == q + ro.responses[i, :n].tolist()
        assert row["loss_mask"] == [0] * len(q) + ro.response_mask[i, :n].int().tolist()


def test_encode_conversation_against_a_naive_rendering(tiny):
    """One turn: the template's prompt, the response, EOS (mask on the last two parts). Two turns: the observation in
    between is the template's rendering of the whole conversation minus what the turns contribute."""
    tok = chat.load_tokenizer(tiny)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    user = [{"role": "user", "content": "What is 6*7?"}]
    ids, mask = encode_conversation(tok, user + [{"role": "assistant", "content": "42"}])
    p = enc(chat.apply_chat(tok, user))
    assert ids == p + enc("42") + [tok.eos_token_id] and mask == [0] * len(p) + [1] * (len(ids) - len(p))
    conv = user + [
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": "<tool_response>42</tool_response>"},
        {"role": "assistant", "content": "42"},
    ]
    ids, mask = encode_conversation(tok, conv)
    full = chat.apply_chat(tok, conv, add_generation_prompt=False)  # the template's text of the whole conversation
    assert tok.decode(ids) == full.rstrip("\n")  # the template's trailing glue after the last EOS is not a turn's
    text_of = lambda keep: tok.decode([t for t, m in zip(ids, mask) if m == keep])
    assert text_of(1) == f"{CALL}<|im_end|>42<|im_end|>"
    assert "<tool_response>42</tool_response>" in text_of(0) and "What is 6*7?" in text_of(0)


def test_sft_refuses_conversations_that_do_not_end_with_the_assistant(tiny, tmp_path):
    from common.core.data import DataError

    tok = chat.load_tokenizer(tiny)
    bad = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    write_rows([{"messages": bad}], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl row 0: 'messages' must end with an assistant turn"):
        load_sft([str(tmp_path / "bad.jsonl")], tok)


def test_forced_prefix_starts_the_first_turn_and_is_part_of_it(tiny):
    tok = chat.load_tokenizer(tiny)
    prefix = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
    reply = lambda ctx: "The answer is 42." if "<tool_response>42" in ctx else '6*7"}}</tool_call>'
    ro, engine = _trajectories(tok, M.load_causal_lm(tiny, tok), reply, n=1, prefix=prefix)
    forced = tok(prefix, add_special_tokens=False)["input_ids"]
    assert engine.contexts[0][-len(forced) :] == forced  # the sampler continued after the forced tokens
    assert ro.messages[0][2] == {"role": "assistant", "content": CALL}  # the turn's text holds them
    assert ro.response_mask[0, : len(forced)].eq(1).all() and ro.logprobs[0, : len(forced)].eq(0).all()
    assert ro.stats["env/tool_calls"].item() == 1 and ro.scores.item() == 1.0
    assert not engine.contexts[1][-len(forced) :] == forced  # only the first turn is forced


def test_tool_learning_rates(tiny):
    """Three trajectories: a call then the answer, an answer without a call, a failing call then the answer."""
    tok = chat.load_tokenizer(tiny)
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*"}}</tool_call>'

    def reply(ctx):
        q = ctx.split("q")[-1][0]
        if "<tool_response>42" in ctx or "<tool_response>error" in ctx:
            return "42"
        return {"0": CALL, "1": "42", "2": bad}[q]

    ro, _ = _trajectories(tok, M.load_causal_lm(tiny, tok), reply, n=3)
    means = {k: v.float().mean().item() for k, v in ro.stats.items()}
    rates = tool_metrics(means)
    assert ro.stats["env/tool_calls"].tolist() == [1, 0, 1] and ro.stats["env/tool_errors"].tolist() == [0, 0, 1]
    assert rates["env/tool_call_rate"] == pytest.approx(2 / 3)
    assert rates["env/tool_success_rate"] == pytest.approx(1 / 2)
    assert rates["env/answer_after_tool"] == pytest.approx(2 / 3)
    assert tool_metrics({"env/turns": 1.0}) == {}  # not the tool environment: nothing added


def test_tool_programs_print_the_answer_of_every_tool_family():
    """common.core.tasks.tool_program, for each tool family (trained and held out): the program, run by the Python tool,
    prints the generator's answer; a family without a writer gets None."""
    from common.core.tasks import TOOL_TASKS_HELD_OUT, TOOL_TASKS_TRAINED, split_task_rows, tool_program
    from common.integrations.sandbox import run_python

    for task in TOOL_TASKS_TRAINED + TOOL_TASKS_HELD_OUT:
        for r in split_task_rows(task, 3, 0, seed=1)[0]:
            row = PromptRow("", r["data_source"], r["reward_model"]["ground_truth"], r["extra_info"])
            out, ok = run_python(tool_program(row))
            assert ok and out == str(row.ground_truth), (task, out, row.ground_truth)
    assert tool_program(PromptRow("", "reasoning_gym/letter_counting", "3", {"entry": "{}"})) is None


@pytest.mark.parametrize("fmt", ["text", "code"])
def test_program_demonstrations_are_correct_replayed_and_load_as_sft(tiny, tool_prompts, tmp_path, fmt):
    """In either protocol (--tool-format text: <tool_call> JSON; code: a <code> block, its output in <output>)."""
    from common.harness.args import EnvArgs

    out = tmp_path / "demos.jsonl"
    env = EnvArgs(env="tools", tools="python", tool_format=fmt)
    report = _gen_demos(prompts=tool_prompts, source="program", out=str(out), model=tiny, env=env)
    rows = read_table(str(out))
    assert report["kept"] == len(rows) == 16  # every program's answer is right: one row per prompt
    prompts = [r for f in tool_prompts for r in read_table(f)]
    for row, src in zip(rows, prompts):
        assert set(row) >= {"messages", "data_source", "reward_model", "extra_info"}
        assert row["extra_info"]["source"] == "program" and row["extra_info"]["reward"] == 1.0
        assert row["data_source"] == src["data_source"] and row["reward_model"]["ground_truth"] == str(
            src["reward_model"]["ground_truth"]
        )
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        # the tool result is what the program printed (the tool really ran), and the answer states it
        gt = src["reward_model"]["ground_truth"]
        tag = "output" if fmt == "code" else "tool_response"
        assert row["messages"][3]["content"] == f"<{tag}>{gt}</{tag}>"
        assert row["messages"][2]["content"].startswith("<code>\n" if fmt == "code" else "<tool_call>{")
        assert row["messages"][4]["content"] == f"<answer>{gt}</answer>"
    sft = load_sft([str(out)], chat.load_tokenizer(tiny))
    assert len(sft) == 16 and all(sum(r["loss_mask"]) > 0 for r in sft)


def test_hand_demonstrations_are_rejected_deduplicated_and_capped(tiny, tool_prompts, tmp_path):
    first = read_table(tool_prompts[0])[0]
    a, b = (int(x) for x in json.loads(first["extra_info"]["entry"])["metadata"]["expression"].split(" * "))
    call = f'<tool_call>{{"name": "python", "arguments": {{"code": "print({a} * {b})"}}}}</tool_call>'
    call2 = f'<tool_call>{{"name": "python", "arguments": {{"code": "x = {a} * {b}\\nprint(x)"}}}}</tool_call>'
    right, wrong = f"<answer>{a * b}</answer>", f"<answer>{a * b + 1}</answer>"
    demos = [
        {"messages": [{"role": "assistant", "content": call}, {"role": "assistant", "content": right}]},
        {"messages": [{"role": "assistant", "content": call}, {"role": "assistant", "content": right}]},  # duplicate
        {"messages": [{"role": "assistant", "content": call}, {"role": "assistant", "content": wrong}]},  # rejected
        {"messages": [{"role": "assistant", "content": right}]},  # right, but no tool call: rejected
        {"messages": [{"role": "assistant", "content": call2}, {"role": "assistant", "content": right}]},
        {"messages": [{"role": "assistant", "content": call2 + " "}, {"role": "assistant", "content": right}]},  # cap
    ]
    write_rows([{**d, "prompt_index": 0} for d in demos], tmp_path / "hand.jsonl")
    out = tmp_path / "kept.jsonl"
    report = _gen_demos(prompts=tool_prompts[:1], source="file", demos=[str(tmp_path / "hand.jsonl")], out=str(out),
                        model=tiny, max_per_prompt=2, summary_out=str(tmp_path / "summary.json"))  # fmt: skip
    kept = read_table(str(out))
    assert len(kept) == 2 and [r["messages"][2]["content"] for r in kept] == [call, call2]
    d = report["per_data_source"]["reasoning_gym/products"]
    assert (d["tried"], d["kept"], d["duplicates"], d["over_cap"]) == (6, 2, 1, 1)
    assert d["tool_call_rate"] == pytest.approx(5 / 6)
    assert json.loads((tmp_path / "summary.json").read_text())["kept"] == 2
    # the same without the tool requirement keeps the right answer that used no tool
    report = _gen_demos(prompts=tool_prompts[:1], source="file", demos=[str(tmp_path / "hand.jsonl")], out=str(out),
                        model=tiny, max_per_prompt=5, require_tool=False)  # fmt: skip
    assert report["kept"] == 4


def test_policy_demonstrations_sample_k_per_prompt_with_a_forced_prefix(tiny, tool_prompts, tmp_path):
    """The tiny random model's samples are wrong: with --min-reward 0 and no tool requirement every distinct one is
    kept (the rejection threshold decides), each starting with the forced prefix; at the default threshold none is,
    which is one line naming what to try."""
    from common.core.errors import UserError

    prefix = '<tool_call>{"name": "python", "arguments": {"code": "print('
    kw = dict(prompts=tool_prompts[:1], model=tiny, num_prompts=2, k=3, prefix=prefix, max_new_tokens=8,
              max_per_prompt=3, env={"env": "tools", "tools": "python", "max_turns": 1})  # fmt: skip
    import tools.gen_demos as G
    from common.harness.args import EnvArgs

    args = lambda **extra: G.Args(**{**kw, **extra, "env": EnvArgs(**kw["env"])})
    report = G.main(args(out=str(tmp_path / "p.jsonl"), min_reward=0.0, require_tool=False))
    rows = read_table(str(tmp_path / "p.jsonl"))
    assert report["tried"] == 6 and len(rows) == 6
    assert all(r["messages"][2]["content"].startswith(prefix) for r in rows)
    assert rows[0]["extra_info"]["source"].startswith(f"policy:{tiny}")
    with pytest.raises(UserError, match="no conversation reached --min-reward 1.0"):
        G.main(args(out=str(tmp_path / "none.jsonl")))
    assert not (tmp_path / "none.jsonl").exists()


# ------------------------------------------------------------------ the KV cache kept across turns (hf engine)
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "greedy"])
def test_kv_cache_across_turns_gives_the_same_trajectories(tiny_agent, sampled, monkeypatch):
    """The agent calls the calculator on half its prompts, then answers: trajectories of 1-3 turns. With each
    trajectory's cache kept across turns (a turn prefills only the EOS and the observation) the ids are those of a full
    prefill per turn, and the sampler's log-probs agree to float rounding."""
    tok = chat.load_tokenizer(tiny_agent)
    model = M.load_causal_lm(tiny_agent, tok)
    words = ["hi", "hello", "count", "go", "yes", "no", "up", "down"]
    rows = [
        PromptRow(text="", data_source="toy", ground_truth="2", messages=[{"role": "user", "content": f"{words[i % 8]} {i}"}])
        for i in range(12)
    ]  # fmt: skip
    eps = Episodes(partial(ToolEnv, ("calculator",)), tok, _score, max_turns=3, max_tokens=160, timeout=10)
    seeds = list(range(12)) if sampled else None
    import common.core.generation as R

    prefills, real = [], R._prefill_after
    monkeypatch.setattr(R, "_prefill_after", lambda *a: prefills.append(a[2].shape) or real(*a))
    with_cache = eps.run(model, rows, seeds, max_new_tokens=40)
    assert len(prefills) >= 1  # turns 2 (and 3) continued each trajectory's cache
    eps.kv_cache = False
    without = eps.run(model, rows, seeds, max_new_tokens=40)
    assert (with_cache.stats["env/turns"] >= 2).sum() >= 3, with_cache.stats["env/turns"]  # the cache was used
    assert torch.equal(with_cache.responses, without.responses)
    assert torch.equal(with_cache.response_mask, without.response_mask)
    if sampled:
        torch.testing.assert_close(with_cache.logprobs, without.logprobs, atol=2e-5, rtol=0)
    assert with_cache.turn_ids == without.turn_ids
