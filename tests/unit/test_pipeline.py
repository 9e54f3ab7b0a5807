"""The seed's workflow from checkpoint paths alone: SFT (LoRA) -> PPO -> self-generated preferences -> DPO
-> side-by-side evaluation; checkpoints are models; resume continues the same run folder; presets parse
like the CLI; export makes a clean model folder."""

import sys

import pytest

from conftest import REPO


def test_prompt_formatting_flags(tiny):
    from common.core import chat as M

    tok = M.load_tokenizer(tiny)
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    default = M.apply_chat(tok, msgs)
    assert "<|im_start|>user" in default
    M.set_prompt_format(tok, apply_chat_template=False)
    assert M.apply_chat(tok, msgs) == "What is 2+2?" and M.apply_chat(tok, "raw text") == "raw text"
    M.set_prompt_format(tok, system_prompt="You are terse.")
    text = M.apply_chat(tok, msgs)
    assert text.startswith("<|im_start|>system\nYou are terse.") and text.count("<|im_start|>system") == 1
    M.set_prompt_format(tok, chat_template_kwargs='{"add_generation_prompt": false}')
    with pytest.raises(TypeError):  # the kwargs really reach apply_chat_template (this one collides with ours)
        M.apply_chat(tok, msgs)
    with pytest.raises(ValueError, match="not JSON"):
        M.set_prompt_format(tok, chat_template_kwargs="{enable_thinking: false}")


def test_preset_keys_may_be_the_old_or_trl_flag_names(tmp_path):
    """A preset written with a renamed field's old name (ppo_epochs) or a TRL alias (num_generations)
    sets the field, as the alias does on the command line."""
    import importlib

    from common.harness.cli import parse_args

    sys.path.insert(0, str(REPO / "algos"))
    (tmp_path / "p.yaml").write_text("ppo_epochs: 3\n")
    assert (
        parse_args(importlib.import_module("ppo_llm").Args, ["--config", str(tmp_path / "p.yaml")]).update_epochs == 3
    )
    (tmp_path / "g.yaml").write_text("num_iterations: 2\nnum_generations: 8\n")
    g = parse_args(importlib.import_module("grpo_llm").Args, ["--config", str(tmp_path / "g.yaml")])
    assert g.update_epochs == 2 and g.group_size == 8
