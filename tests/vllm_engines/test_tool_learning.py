"""Teaching the tool (docs/agents.md, "Teach the tool"): multi-turn SFT renders a conversation exactly as a rollout of
it is rendered (ids and loss mask), demonstrations from the policy, from programs and by hand (rejection, schema,
duplicates, the cap), the forced prefix, the rates of tool learning, and the chain from checkpoint folders."""

import sys

import pytest

from common.core.data import read_table
from conftest import REPO

sys.path.insert(0, str(REPO / "algos"))


@pytest.mark.vllm
def test_policy_demonstrations_on_the_vllm_engine(tiny_agent, tool_prompts, tmp_path):
    """tools.gen_demos --source policy --rollout-engine vllm: the forced prefix goes to vLLM as token ids with the
    context, and the rows hold it."""
    import subprocess

    prefix = '<tool_call>{"name": "python", "arguments": {"code": "print('
    out = tmp_path / "demos.jsonl"
    cmd = ["-m", "tools.gen_demos", "--model", tiny_agent, "--prompts", tool_prompts[0], "--num-prompts", 2, "--k", 2,
           "--prefix", prefix, "--max-new-tokens", 8, "--min-reward", -1, "--no-require-tool", "--max-per-prompt", 2,
           "--rollout-engine", "vllm", "--out", out]  # fmt: skip
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_table(str(out))
    assert 1 <= len(rows) <= 4 and all(r["messages"][2]["content"].startswith(prefix) for r in rows)
