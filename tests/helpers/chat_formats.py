"""Tiny random models in the formats users train (issue 64): the Qwen2 / Qwen3 / Llama architectures with chat
templates written here that render Qwen2.5's and Llama 3.1's public formats (ChatML turns closed by <|im_end|> with
Hermes tool calls; Llama 3's header tokens, <|eot_id|> / <|eom_id|>, bare-JSON calls with "parameters"). The
tokenizer is SmolLM2's with the formats' special tokens added, so the models stay as small as the other tiny ones.

- qwen2.5-base: EOS <|endoftext|> (and its generation config says only that), turns end <|im_end|>: a response must
  stop at the template's end of turn, which neither EOS source names.
- qwen3: EOS <|im_end|>, generation config [<|im_end|>, <|endoftext|>] (the pad: never a stop), Qwen3's q/k norms.
- llama3.1: EOS <|end_of_text|> (a base model's), generation config [<|end_of_text|>, <|eom_id|>, <|eot_id|>]."""

import json
from pathlib import Path

import torch

from common.core import chat, defaults
from common.core import models as M
from common.core.chat import TOOL_SCHEMAS, format_tool_call, resolve_tool_format
from common.core.data import encode_conversation

QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}{{ '\n<tool_response>\n' }}
{{- m.content }}{{ '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024

{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}<|eot_id|>
{%- set first_user = namespace(done=false) %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'tool' or m.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls is defined %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{% if c.function.name == 'brave_search' %}<|python_tag|>{{ c.function.name }}.call()\
<|eom_id|>{% else %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}<|eot_id|>\
{% endif %}{% endfor %}
{%- elif m.role == 'user' and tools and not first_user.done %}
{%- set first_user.done = true %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best \
answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use \
variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

LLAMA3_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"]  # fmt: skip
FORMATS = ("qwen2.5-base", "qwen3", "llama3.1")


def tiny_chat_model(out_dir, fmt: str, hidden: int = 64, layers: int = 2, heads: int = 1, init_std: float = 0.2,
                    seed: int = 0) -> str:  # fmt: skip
    """A random model of format `fmt` (FORMATS) saved to `out_dir` with its tokenizer, template and generation
    config; returns the folder (load it with common.core.chat.load_tokenizer / load_causal_lm, as users do)."""
    from transformers import (
        AddedToken,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    from common.core import chat

    out_dir = Path(out_dir)
    tok = chat.load_tokenizer(defaults.DEFAULT_MODEL)
    if fmt == "llama3.1":
        tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
        tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", "<|end_of_text|>", None
        tok.chat_template, eos = LLAMA3_TEMPLATE, ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    else:
        tok.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
        tok.chat_template = QWEN_TEMPLATE
        if fmt == "qwen2.5-base":  # EOS <|endoftext|>, as is its pad (load_tokenizer adds one)
            tok.eos_token, tok.pad_token, eos = "<|endoftext|>", "<|endoftext|>", ["<|endoftext|>"]
        else:
            tok.eos_token, tok.pad_token, eos = "<|im_end|>", "<|endoftext|>", ["<|im_end|>", "<|endoftext|>"]
    vocab = (len(tok) + 1 + 63) // 64 * 64  # spare rows, as the hub's checkpoints have (room for an added pad)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                  initializer_range=init_std, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    if fmt == "llama3.1":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    elif fmt == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // heads, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    ids = [tok.convert_tokens_to_ids(t) for t in eos]
    model.generation_config.eos_token_id = ids if len(ids) > 1 else ids[0]
    model.generation_config.pad_token_id = None
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "generation_config.json").read_text())
    assert cfg["eos_token_id"] == model.generation_config.eos_token_id, cfg
    return str(out_dir)


CALL = {"name": "calculator", "arguments": {"expression": "1+1"}}


def tool_agent(fmt: str, path: str, out, call: dict = CALL) -> str:
    """`path` fine-tuned in-process to make `call` (the calculator's 1+1, or the Python tool's print(1+1)) in its
    format on turn 1 and answer "2" after the result:
    the conversations encoded by encode_conversation (the template's tools= listing, its end of turn, its tool
    messages), as multi-turn SFT encodes them."""
    tok = chat.load_tokenizer(path)
    model = M.load_causal_lm(path, tok)
    seqs = []
    for i in range(8):
        msgs = [{"role": "user", "content": f"what is 1+1? ({i})"},
                {"role": "assistant", "content": format_tool_call(call["name"], call["arguments"], resolve_tool_format(tok))},
                {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]  # fmt: skip
        seqs.append(encode_conversation(tok, msgs, tools=[TOOL_SCHEMAS[call["name"]]]))
    L = max(len(ids) for ids, _ in seqs)
    x = torch.full((len(seqs), L), tok.pad_token_id)
    attn, target = torch.zeros(len(seqs), L, dtype=torch.long), torch.full((len(seqs), L), -100)
    for k, (ids, mask) in enumerate(seqs):
        x[k, : len(ids)], attn[k, : len(ids)] = torch.tensor(ids), 1
        target[k, : len(ids) - 1] = torch.where(torch.tensor(mask[1:]) == 1, torch.tensor(ids[1:]), -100)
    pick = target != -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        hidden = model.model(input_ids=x, attention_mask=attn).last_hidden_state
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[pick]), target[pick])
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05, loss.item()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def sum_task(tmp_path):
    """(a 4-row verl-style file of "what is 1+1?" questions, a reward file scoring the answer "2"): the data the tool
    agents' GRPO runs train on."""
    data, reward = tmp_path / "q.jsonl", tmp_path / "reward.py"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"what is 1+1? ({i})"}],
                                        "data_source": "sum", "reward_model": {"ground_truth": "2"}}) + "\n"
                            for i in range(4)))  # fmt: skip
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str.strip() == ground_truth)\n")  # fmt: skip
    return data, reward
