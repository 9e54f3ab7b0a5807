"""The formats users train in (issue 64, item 8): Qwen2.5 / Qwen3 / Llama 3.1 tiny models (tests/helpers/chat_formats.py).
Responses stop at the template's end of turn (not only the tokenizer's EOS), SFT appends that token, tool calls in
each template's format are parsed and run through ToolEnv, and a template whose format is unknown is one line."""

from functools import partial
from types import SimpleNamespace

import pytest

from chat_formats import CALL, sum_task, tiny_chat_model, tool_agent
from common.core import chat
from common.core import models as M
from common.core.chat import format_tool_call
from common.core.envs import Episodes
from common.integrations.builtin_envs import ToolEnv


# the agent's fine-tuning is ~15 s a format: beyond the fast tier (whose in-process tests parse each format)
@pytest.mark.e2e
@pytest.mark.parametrize("fmt", ["qwen2.5-base", "qwen3", "llama3.1"])
def test_a_tool_call_in_each_format_runs_and_the_turn_ends_at_the_template_stop(fmt, tmp_path):
    """Greedy trajectories of the fine-tuned tiny agent through ToolEnv: turn 1 is a call in the template's format
    that ends at its end of turn (<|im_end|> where Qwen2.5's EOS is <|endoftext|>; <|eot_id|> where Llama's is
    <|end_of_text|>), the calculator runs (no tool error), the result is rendered by the template, and turn 2
    answers "2", scored 1."""
    agent = tool_agent(fmt, tiny_chat_model(tmp_path / "init", fmt), tmp_path / "agent")
    tok = chat.load_tokenizer(agent)
    model = M.load_causal_lm(agent, tok)
    score = lambda row, text: float(text.strip() == "2")  # noqa: E731
    episodes = Episodes(partial(ToolEnv, ("calculator",)), tok, score, 3, 96, 30.0, workers=False)
    assert episodes.tool_format == ("llama3" if fmt == "llama3.1" else "hermes")
    rows = [SimpleNamespace(messages=[{"role": "user", "content": f"what is 1+1? ({i})"}], text="") for i in (0, 5)]
    ro = episodes.run(model, rows, None, max_new_tokens=40)
    assert ro.stats["env/tool_calls"].tolist() == [1.0, 1.0] and ro.stats["env/tool_errors"].tolist() == [0.0, 0.0]
    assert ro.scores.tolist() == [1.0, 1.0] and ro.is_eos.all() and ro.stats["env/turns"].tolist() == [2.0, 2.0]
    end = chat.turn_end_id(tok)
    for b in range(2):
        (_, first), (context, second) = ro.turn_ids[b]  # each turn: (the ids it was given, the ids it sampled)
        assert first[-1] == second[-1] == end and end not in first[:-1] + second[:-1]
        assert tok.decode(first[:-1]) == format_tool_call("calculator", CALL["arguments"], episodes.tool_format)
        text = tok.decode(context)  # the prompt, turn 1 and the result as the template renders a tool message
        assert (
            "<tool_response>\n2\n</tool_response>" if fmt != "llama3.1" else "ipython<|end_header_id|>\n\n2"
        ) in text


@pytest.mark.e2e
def test_grpo_env_tools_on_a_llama3_format_model(tmp_path):
    """`grpo_llm.py --env tools` from the Llama 3.1-format agent's folder, as a user runs it: its bare-JSON calls
    run (env/tool_success_rate 1), its turns end at <|eot_id|> (no trajectory truncated), and it answers."""

    from conftest import only_run, read_metrics, run_script

    agent = tool_agent("llama3.1", tiny_chat_model(tmp_path / "init", "llama3.1"), tmp_path / "agent")
    data, reward = sum_task(tmp_path)
    run_script("grpo_llm.py", "--model-name-or-path", agent, "--train-files", data, "--reward-fn",
               f"{reward}:compute_score", "--env", "tools", "--tools", "calculator", "--max-turns", 3,
               "--max-new-tokens", 40, "--total-steps", 1, "--num-prompts", 2, "--group-size", 2,
               "--mini-batch-size", 4, "--micro-batch-size", 4, "--eval-every", 0, "--mixed-precision", "no",
               "--output-dir", tmp_path / "run")  # fmt: skip
    (m,) = read_metrics(only_run(tmp_path / "run"))
    assert m["env/tool_call_rate"] == 1.0 and m["env/tool_success_rate"] == 1.0, m
    assert m["train/reward"] > 0.5, m
