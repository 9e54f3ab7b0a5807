"""Tokenizers and chat rendering: tokenizer hygiene (padding side, pad token), the prompt format a run
records, the template's turn end and stop tokens, `apply_chat`, and the tool-call formats a template writes
(hermes, llama3, text: `resolve_tool_format`, `parse_tool_calls`, `format_tool_call`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.core.defaults import DEFAULT_MODEL, SMOLLM2_GGUF, SMOLLM2_PIP, cache_dir  # noqa: F401 -- M.DEFAULT_MODEL
from common.core.errors import UserError
from common.core.hub import resolve_model_path


# ---------------------------------------------------------------------------------------------
# Tokenizer hygiene
# ---------------------------------------------------------------------------------------------
def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, padding_side: str = "left"):
    """Tokenizer with left padding (generation) and a pad token that is not EOS.

    When pad == EOS, masking out pads also masks the real EOS the model must learn to emit, and the
    policy never learns to stop. We pick an existing non-EOS special token (e.g. `<|endoftext|>`),
    or add `<|pad|>` (the caller must then resize the embeddings: see `load_causal_lm`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    tok.padding_side = padding_side
    if tok.eos_token_id is None:
        raise UserError(f"tokenizer of {name_or_path} has no EOS token; responses could never end")
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        candidates = [tok.unk_token, "<|endoftext|>", "<|finetune_right_pad_id|>", "<pad>"]
        vocab = tok.get_vocab()
        pad = next((c for c in candidates if c and c in vocab and vocab[c] != tok.eos_token_id), None)
        if pad is None:
            tok.add_special_tokens({"pad_token": "<|pad|>"})
        else:
            tok.pad_token = pad
    return tok


def set_prompt_format(
    tok,
    apply_chat_template: bool = True,
    chat_template_kwargs: str | dict | None = None,
    system_prompt: str | None = None,
):
    """How `apply_chat` renders prompts for this tokenizer (the scripts' --apply-chat-template,
    --chat-template-kwargs and --system-prompt). Kept on the tokenizer so every loader (prompts,
    preferences, SFT examples) renders alike. Returns `tok`."""
    import json

    if isinstance(chat_template_kwargs, str):
        try:
            chat_template_kwargs = json.loads(chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise UserError(
                f"--chat-template-kwargs {chat_template_kwargs!r}: not JSON ({e.msg}); "
                f"e.g. '{{\"enable_thinking\": false}}'"
            ) from None
        if not isinstance(chat_template_kwargs, dict):
            raise UserError("--chat-template-kwargs: expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    tok.cleanrlhf_format = {
        "apply_chat_template": apply_chat_template,
        "kwargs": chat_template_kwargs or {},
        "system_prompt": system_prompt,
    }
    return tok


def prompt_format(tok) -> dict:
    """The keywords of `set_prompt_format` that render prompts as `tok` does now (saved with a reward model)."""
    fmt = getattr(tok, "cleanrlhf_format", None) or {"apply_chat_template": True, "kwargs": {}, "system_prompt": None}
    return dict(
        apply_chat_template=fmt["apply_chat_template"],
        chat_template_kwargs=fmt["kwargs"],
        system_prompt=fmt["system_prompt"],
    )


def load_reward_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """A reward model's own tokenizer, rendering prompts as rm_llm.py trained it: the --apply-chat-template,
    --chat-template-kwargs and --system-prompt of its run, saved in its config as `reward_prompt_format`
    (a reward model from elsewhere: the tokenizer's defaults)."""
    from transformers import AutoConfig

    tok = load_tokenizer(name_or_path, trust_remote_code)
    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    return set_prompt_format(tok, **(getattr(config, "reward_prompt_format", None) or {}))


def check_context(name_or_path: str, n_tokens: int, what: str, trust_remote_code: bool = False) -> None:
    """A sequence budget (`what`, e.g. --max-prompt-length + --max-new-tokens) that the model's context
    cannot hold is a user error, said before the weights load (positions past it give garbage or crash)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    context = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    if context and n_tokens > context:
        raise UserError(f"{what} = {n_tokens} tokens: more than the model's context of {context} ({name_or_path})")


def prompt_tokenizer(model, data, n_tokens: int, what: str):
    """The tokenizer of a script's flags (common.harness.args.ModelArgs `model`, DataArgs `data`): the sequence budget
    `what` = `n_tokens` checked against the model's context (before any weights load), left padding and a pad
    token that is not EOS (`load_tokenizer`), prompts rendered as --apply-chat-template / --chat-template-kwargs
    / --system-prompt say (`set_prompt_format`)."""
    check_context(model.model_name_or_path, n_tokens, what, model.trust_remote_code)
    tok = load_tokenizer(model.model_name_or_path, model.trust_remote_code)
    return set_prompt_format(tok, data.apply_chat_template, data.chat_template_kwargs, data.system_prompt)


def check_same_tokenizer(tok, other: str, flag: str, trust_remote_code: bool = False) -> None:
    """A second model's folder (a distillation teacher) has `tok`'s vocabulary, token for id, and its EOS: per-token
    log-probs of one model are then about the other's tokens. Else one line naming the flag and the first
    difference (before any weights load)."""
    theirs = load_tokenizer(other, trust_remote_code)
    mine_v, their_v = tok.get_vocab(), theirs.get_vocab()
    if mine_v != their_v:
        diff = sorted(set(mine_v.items()) ^ set(their_v.items()), key=lambda kv: kv[1])[:1]
        raise UserError(
            f"{flag} {other}: its tokenizer differs from the student's ({len(their_v)} vs {len(mine_v)} tokens; first "
            f"difference: {diff[0] if diff else '?'}); distillation needs the same tokenizer"
        )
    if theirs.eos_token_id != tok.eos_token_id:
        raise UserError(f"{flag} {other}: its EOS token ({theirs.eos_token}) is not the student's ({tok.eos_token})")


def vocab_rows(name_or_path: str, trust_remote_code: bool = False) -> int:
    """The rows of a causal LM's head (config.vocab_size; often padded past its tokenizer's length), before loading."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(name_or_path), trust_remote_code=trust_remote_code)
    return (getattr(config, "text_config", None) or config).vocab_size


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def turn_end_id(tok) -> int:
    """The token the chat template closes an assistant turn with (what SFT appends to a response and a multi-turn
    rollout's turn ends with): the first end-of-turn token (END_OF_TURN or EOS) written after an assistant message;
    EOS without a template or where it writes none. Qwen2.5 base: <|im_end|> (its EOS is <|endoftext|>)."""
    return _stops(tok)[0]


def stop_ids(tok) -> list[int]:
    """Every token that ends a response (generation stops there; `common.core.generation.response_masks` counts it as
    the end): the template's turn end first, then EOS, the model folder's generation_config.json `eos_token_id` (an int
    or a list: Llama 3.1's [<|end_of_text|>, <|eom_id|>, <|eot_id|>]) and the END_OF_TURN tokens the template writes.
    Never the pad token (right padding after a stop-string row would read as a stop; Qwen2.5-Instruct's pad
    <|endoftext|> is also in its generation config: its turns end at <|im_end|>). Cached on `tok`."""
    return _stops(tok)


def _stops(tok) -> list[int]:
    fmt = getattr(tok, "cleanrlhf_format", None)
    template = getattr(tok, "chat_template", None)
    key = (template, repr(fmt), tok.eos_token_id, getattr(tok, "pad_token_id", None))
    cached = getattr(tok, "_cleanrlhf_stops", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if not hasattr(tok, "get_vocab"):  # a stand-in tokenizer (tests' fakes): EOS only
        return [tok.eos_token_id]
    vocab = tok.get_vocab()
    marks = {t: vocab[t] for t in (*END_OF_TURN, tok.eos_token) if t and t in vocab}
    end = tok.eos_token_id
    if template and (fmt is None or fmt["apply_chat_template"]):
        text = apply_chat(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Zq7"}], False)
        after = text[text.rindex("Zq7") + 3 :]
        first = min((after.find(t), t) for t in marks if t in after) if any(t in after for t in marks) else None
        end = marks[first[1]] if first else end
    ids = [end, tok.eos_token_id]
    ids += [i for t, i in marks.items() if t in (template or "")]
    folder = Path(str(getattr(tok, "name_or_path", "") or "-"))
    config = folder / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    ids = [i for i in dict.fromkeys(ids) if i is not None and i != tok.pad_token_id]
    tok._cleanrlhf_stops = (key, ids)
    return ids


def apply_chat(tok, prompt, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """A prompt (string or list of {role, content}) as the text the model sees.

    Message lists go through the tokenizer's chat template when it has one; a plain string is
    wrapped as one user message when a template exists, else used as is. `set_prompt_format` can
    turn the template off (raw text: a string as is, messages' contents joined), pass keyword
    arguments to it (e.g. enable_thinking), and put a system prompt first (default: the template's own)."""
    fmt = getattr(tok, "cleanrlhf_format", None) or {"apply_chat_template": True, "kwargs": {}, "system_prompt": None}
    if not fmt["apply_chat_template"]:
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if isinstance(prompt, str):
        if not tok.chat_template:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if fmt["system_prompt"] is not None and not (prompt and prompt[0]["role"] == "system"):
        prompt = [{"role": "system", "content": fmt["system_prompt"]}] + list(prompt)
    if not tok.chat_template:  # no template: a plain "role: content" transcript
        return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + (
            "assistant: " if add_generation_prompt else ""
        )
    kw = dict(fmt["kwargs"], tools=tools) if tools else fmt["kwargs"]  # tools: an environment's (common/core/envs.py)
    return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
CODE_BLOCK = re.compile(r"<code>(.*?)</code>", re.S)  # --tool-format code: a program the Python tool runs
# the stop string that ends a model turn at its call's closing tag (the generation stops there; the trainer's ids get
# the template's turn end after it, as verl / SGLang do), by tool format
TOOL_STOPS = {"code": ["</code>"]}

TOOL_SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code (standard library only) and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
}


TOOL_FORMATS = ("hermes", "llama3", "text")


def resolve_tool_format(tok, requested: str = "auto") -> str:
    """How tool calls are written for `tok`'s chat template (--tool-format; auto: read from the template):
    hermes (Qwen2.5/Qwen3, Hermes: the template lists tools= and asks for `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`; results are `tool` messages it wraps in <tool_response>), llama3 (Llama 3.1-3.3: the turn is
    bare JSON `{"name": ..., "parameters": {...}}`, optionally after <|python_tag|>; results are `tool` (ipython)
    messages), text (a template without tools=: ToolEnv's own protocol in the system message, `<tool_call>` JSON
    with "arguments", results in a user message), or "unknown" (a template that renders tools= in another way).
    code (asked for only): a program between <code> and </code> (ReTool's protocol, the Python tool only), in the
    system message whatever the template; the turn stops at </code> (TOOL_STOPS), the output comes back as <output>."""
    template = tok.chat_template or ""
    if requested != "auto":
        if requested not in ("text", "code") and "tools" not in template:
            raise UserError(f"--tool-format {requested}: the chat template of {tok.name_or_path} renders no tools=; "
                            "use --tool-format text (the tools listed in the system message)")  # fmt: skip
        return requested
    if "tools" not in template:
        return "text"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3"
    return "unknown"


def _tool_call(call, key: str = "arguments") -> dict | str:
    """A decoded call object -> {name, arguments} or an error message (str); the arguments under `key`."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f'error: a tool call is {{"name": ..., "{key}": {{...}}}}'
    args = call.get(key, call.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict):
        return f'error: "{key}" must be an object'
    return {"name": call["name"], "arguments": args}


def parse_tool_calls(text: str, fmt: str = "text") -> list[dict | str]:
    """The calls of a model turn in format `fmt` (resolve_tool_format), each {name, arguments} or an error message
    (str) for a call that is not such JSON; [] for an answer. hermes / text: the `<tool_call>{json}</tool_call>`
    blocks (a `<tool_call>` without its closing tag is one malformed call). llama3: a turn that starts with `{`
    (after an optional <|python_tag|>) is one or more JSON objects separated by `;` or white space. code: each
    `<code>...</code>` block, a call of the Python tool with that program (an unclosed `<code>`: one malformed call)."""
    if fmt == "llama3":
        return _json_calls(text)
    if fmt == "code":  # each <code> block a program for the Python tool
        calls = [{"name": "python", "arguments": {"code": body.strip()}} for body in CODE_BLOCK.findall(text)]
        return calls or (["error: <code> without </code>"] if "<code>" in text else [])
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            calls.append(_tool_call(json.loads(body.strip())))
        except json.JSONDecodeError as e:
            calls.append(f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not calls and "<tool_call>" in text:
        calls.append("error: <tool_call> without </tool_call>")
    return calls


def _json_calls(text: str) -> list[dict | str]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls, i, decoder = [], 0, json.JSONDecoder()
    while i < len(body) and body[i] == "{":
        try:
            call, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            calls.append(f"error: the tool call is not valid JSON ({e.msg} at character {e.pos})")
            break
        calls.append(_tool_call(call, "parameters"))
        while i < len(body) and body[i] in " \t\n;":
            i += 1
    return calls


def format_tool_call(name: str, arguments: dict, fmt: str) -> str:
    """A call as a model turn writes it in format `fmt` (tools.gen_demos' program demonstrations)."""
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": arguments})
    if fmt == "code":
        if name != "python":
            raise ValueError(f"--tool-format code calls the Python tool only, not {name!r}")
        return f"<code>\n{arguments['code']}\n</code>"
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"
