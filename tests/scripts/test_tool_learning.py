"""Teaching the tool (docs/agents.md, "Teach the tool"): multi-turn SFT renders a conversation exactly as a rollout of
it is rendered (ids and loss mask), demonstrations from the policy, from programs and by hand (rejection, schema,
duplicates, the cap), the forced prefix, the rates of tool learning, and the chain from checkpoint folders."""

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, only_run, read_metrics, run_script, run_tool
from shared_tool_learning import _gen_demos

sys.path.insert(0, str(REPO / "algos"))


# ------------------------------------------------------------------ the chain, from checkpoint folders
@pytest.mark.e2e
def test_the_tool_chain_runs_from_checkpoint_folders(tiny_agent, tool_prompts, tmp_path):
    """Demonstrations -> sft_llm.py -> grpo_llm.py --env tools (and ppo_llm.py --env tools), each stage from the
    previous stage's checkpoint folder, then tools.evaluate --env tools on the result: the commands of
    docs/agents.md."""

    demos = tmp_path / "demos.jsonl"
    _gen_demos(prompts=tool_prompts, source="program", out=str(demos), model=tiny_agent)
    common = ["--output-dir", tmp_path / "runs", "--eval-every", 0, "--total-steps", 2]
    run_script("sft_llm.py", "--model-name-or-path", tiny_agent, "--train-files", demos, "--batch-size", 4,
               "--micro-batch-size", 4, "--learning-rate", 1e-3, "--exp-name", "sft", *common)  # fmt: skip
    sft_run = only_run(tmp_path / "runs")
    assert read_metrics(sft_run)[-1]["loss/sft"] > 0
    sft_ckpt = sft_run / "checkpoints" / "step_2" / "policy"
    rl = ["--model-name-or-path", sft_ckpt, "--train-files", *tool_prompts, "--env", "tools", "--tools", "python",
          "--max-new-tokens", 24, "--max-trajectory-tokens", 96, "--micro-batch-size", 4, *common]  # fmt: skip
    # GRPO from the tool preset of docs/agents.md (its values, then these flags over them)
    run_script("grpo_llm.py", "--config", REPO / "configs/grpo_tools_cpu.yaml", *rl, "--num-prompts", 2,
               "--group-size", 2, "--mini-batch-size", 4, "--exp-name", "grpo")  # fmt: skip
    run_script("ppo_llm.py", *rl, "--batch-size", 4, "--mini-batch-size", 4, "--exp-name", "ppo")
    runs = {p.name.split("__")[1]: p for p in (tmp_path / "runs").iterdir()}
    for name in ("grpo", "ppo"):
        rows = read_metrics(runs[name])
        assert [r["step"] for r in rows] == [1, 2] and "env/tool_call_rate" in rows[-1], rows[-1]
        assert json.loads((runs[name] / "args.json").read_text())["model_name_or_path"] == str(sft_ckpt)
    assert json.loads((runs["grpo"] / "args.json").read_text())["learning_rate"] == 2e-6  # the preset's, not 5e-6
    final = runs["grpo"] / "checkpoints" / "step_2" / "policy"
    out = tmp_path / "eval.json"
    run_tool("tools.evaluate", "--models", sft_ckpt, final, "--data", *tool_prompts, "--num-prompts", 4,
             "--max-new-tokens", 16, "--env", "tools", "--tools", "python", "--json-out", out)  # fmt: skip
    res = json.loads(out.read_text())
    assert {f"{sft_ckpt} + tools", f"{final} + tools"} <= set(res)
    assert "tool_call_rate" in res[f"{final} + tools"]["all"]


@pytest.mark.e2e
def test_the_self_taught_chain_hands_each_rounds_checkpoint_to_the_next(tiny, tool_prompts, tmp_path):
    """tools.self_teach (issue 68, item 3): round 1 samples with the base and a forced prefix, keeps what passes,
    fine-tunes (sft_llm.py, its own process); round 2 samples with round 1's checkpoint folder and no prefix; the yield
    of each round in yield.json. (A random tiny model earns no reward: --min-reward 0 keeps what it wrote, so this
    checks the chain, not its yield.)"""
    from common.core import chat
    from common.core import models as M
    from common.harness.args import EnvArgs
    from tools import self_teach as T

    out = tmp_path / "chain"
    env = EnvArgs(env="tools", tools="python", tool_format="code", max_turns=2, max_trajectory_tokens=64)
    args = T.Args(prompts=tool_prompts, model=tiny, rounds=2, k=2, prefix="<code>", num_prompts=3, min_reward=0.0,
                  require_tool=False, max_new_tokens=8, sft_steps=2, sft_flags="--batch-size 2 --micro-batch-size 2",
                  out_dir=str(out), env=env)  # fmt: skip
    table = T.main(args)
    assert json.loads((out / "yield.json").read_text()) == table and [t["round"] for t in table] == [1, 2]
    first, second = table
    assert first["sampled_with"] == tiny and first["prefix"] == "<code>" and second["prefix"] == ""
    assert second["sampled_with"] == first["wrote"] and Path(first["wrote"]).is_dir()
    assert first["wrote"].startswith(str(out / "round_1" / "sft")) and second["wrote"].startswith(str(out / "round_2"))
    assert 0 < first["kept"] <= first["tried"] == 3 * 2 and 0 < first["yield"] <= 1
    demos = [json.loads(x) for x in (out / "round_1" / "demos.jsonl").read_text().splitlines()]
    firsts = [next(m for m in d["messages"] if m["role"] == "assistant")["content"] for d in demos]
    assert all(t.startswith("<code>") for t in firsts), firsts  # the forced opening is part of the turn
    M.load_causal_lm(second["wrote"], chat.load_tokenizer(second["wrote"]))  # the last round's checkpoint loads
