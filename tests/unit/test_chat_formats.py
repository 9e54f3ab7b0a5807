"""The formats users train in (issue 64, item 8): Qwen2.5 / Qwen3 / Llama 3.1 tiny models (tests/helpers/chat_formats.py).
Responses stop at the template's end of turn (not only the tokenizer's EOS), SFT appends that token, tool calls in
each template's format are parsed and run through ToolEnv, and a template whose format is unknown is one line."""

import pytest
import torch

from chat_formats import CALL, FORMATS, QWEN_TEMPLATE, tiny_chat_model
from common.core import chat
from common.core.chat import parse_tool_calls, resolve_tool_format
from common.core.data import encode_conversation, observation_ids, turn_glue
from common.core.envs import Episodes
from common.core.errors import UserError
from common.integrations.builtin_envs import ToolEnv


@pytest.fixture(scope="module", params=FORMATS)
def chat_model(request, tmp_path_factory):
    return request.param, tiny_chat_model(tmp_path_factory.mktemp(request.param.replace(".", "_")), request.param)


def _names(tok, ids):
    return [tok.convert_ids_to_tokens(i) for i in ids]


def test_each_format_stops_at_its_templates_end_of_turn(chat_model):
    """Qwen2.5 base: EOS <|endoftext|>, turns end <|im_end|> (from the template); Qwen3: the pad <|endoftext|> is in
    its generation config but never a stop; Llama 3.1 base: <|eot_id|> and <|eom_id|> from the generation config."""
    fmt, path = chat_model
    tok = chat.load_tokenizer(path)
    want = {
        "qwen2.5-base": (["<|im_end|>", "<|endoftext|>"], "\n", "hermes"),
        "qwen3": (["<|im_end|>"], "\n", "hermes"),
        "llama3.1": (["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"], "", "llama3"),
    }[fmt]
    assert (_names(tok, chat.stop_ids(tok)), turn_glue(tok), resolve_tool_format(tok)) == want
    assert tok.pad_token_id not in chat.stop_ids(tok) and chat.turn_end_id(tok) == chat.stop_ids(tok)[0]
    # SFT's rows end with the template's end of turn, as the template renders an assistant message
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    ids, mask = encode_conversation(tok, msgs)
    assert ids[-1] == chat.turn_end_id(tok) and mask[-1] == 1
    assert tok.decode(ids + tok(turn_glue(tok), add_special_tokens=False)["input_ids"]) == chat.apply_chat(
        tok, msgs, False
    )
    # a tool result renders as the template renders a `tool` message
    obs = tok.decode(observation_ids(tok, [{"role": "tool", "content": "2"}]))
    assert ("<tool_response>\n2\n</tool_response>" if fmt != "llama3.1" else "ipython<|end_header_id|>\n\n2") in obs


def test_tool_calls_parse_in_each_format():
    """hermes/text: <tool_call> blocks with "arguments"; llama3: the turn is bare JSON with "parameters" (after an
    optional <|python_tag|>, several separated by ';'); an answer is no call; malformed calls are one error each."""
    hermes = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    assert parse_tool_calls(hermes, "hermes") == parse_tool_calls(hermes) == [CALL]
    assert parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
                            "</tool_call>", "hermes") == [CALL]  # fmt: skip
    assert parse_tool_calls("<tool_call>{oops}</tool_call>", "hermes")[0].startswith("error: the tool call is not")
    assert parse_tool_calls("<tool_call>{", "hermes") == ["error: <tool_call> without </tool_call>"]
    llama = '{"name": "calculator", "parameters": {"expression": "1+1"}}'
    assert parse_tool_calls(llama, "llama3") == parse_tool_calls(" <|python_tag|>" + llama + "\n", "llama3") == [CALL]
    two = parse_tool_calls(llama + "; " + llama.replace("1+1", "2*3"), "llama3")
    assert two == [CALL, {"name": "calculator", "arguments": {"expression": "2*3"}}]
    assert parse_tool_calls("The answer is 2.", "llama3") == [] and parse_tool_calls(llama, "hermes") == []
    assert parse_tool_calls('{"name": "calculator", "parameters": 3}', "llama3") == [
        'error: "parameters" must be an object'
    ]
    assert parse_tool_calls('{"name": "calculator", "par', "llama3")[0].startswith("error: the tool call is not valid")
    assert parse_tool_calls('{"tool": 1}', "llama3") == ['error: a tool call is {"name": ..., "parameters": {...}}']


def test_a_template_with_an_unknown_tool_format_is_one_line(tmp_path):
    path = tiny_chat_model(tmp_path / "m", "qwen3")
    tok = chat.load_tokenizer(path)
    score = lambda row, text: 0.0  # noqa: E731
    tok.chat_template = QWEN_TEMPLATE.replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    with pytest.raises(UserError, match="renders tools= in a format the tool parser does not know.*--tool-format text"):
        Episodes(ToolEnv, tok, score, 2, 64, 10.0)
    assert Episodes(ToolEnv, tok, score, 2, 64, 10.0, tool_format="text").tool_format == "text"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no tools= at all
    with pytest.raises(UserError, match="--tool-format hermes: the chat template of .* renders no tools="):
        Episodes(ToolEnv, tok, score, 2, 64, 10.0, tool_format="hermes")


def test_the_vllm_server_engine_stops_at_the_templates_end_of_turn(tmp_path, monkeypatch):
    """The server is asked to stop at every stop id (stop_token_ids), and a response that ends at <|eot_id|> (a Llama
    3.1 base model's EOS is <|end_of_text|>) counts as ended, not truncated; one cut by max_tokens is truncated."""
    from common.integrations.vllm_server import ServerEngine

    tok = chat.load_tokenizer(tiny_chat_model(tmp_path / "m", "llama3.1"))
    eot, word = tok.convert_tokens_to_ids("<|eot_id|>"), tok("ok", add_special_tokens=False)["input_ids"][0]
    sent = []

    class FakeHttp:
        url = "http://fake"

        def call_all(self, calls, concurrency):
            sent.extend(calls)
            return [{"choices": [{"token_ids": ids, "stop_reason": None}]} for ids in ([word, eot], [word] * 3)]

    engine = object.__new__(ServerEngine)
    engine.tok, engine.http, engine.concurrency, engine.lora_name, engine.fingerprint = tok, FakeHttp(), 4, None, None
    monkeypatch.setattr(engine, "_ready", lambda: None, raising=False)
    queries, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    gen = engine.generate(queries, mask, 3, seeds=None)
    assert [c[1]["sampling_params"]["stop_token_ids"] for c in sent] == [chat.stop_ids(tok)] * 2
    assert set(_names(tok, chat.stop_ids(tok))) == {"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"}
    assert gen.is_eos.tolist() == [True, False] and gen.truncated.tolist() == [False, True]
    assert gen.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
