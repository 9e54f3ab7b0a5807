"""--tool-sandbox remote (common/integrations/sandbox_service.py) against a local server speaking SandboxFusion's API
(tests/helpers/sandbox_fusion_server.py: the sandbox-fusion package's own request and answer models): the code runs there,
each call is bounded, a failing service is retried then counted (the run goes on), its key is sent to it and never
across a redirect, and a run with no service there stops at start-up with one line."""

import pytest


@pytest.mark.e2e
def test_grpo_env_tools_runs_its_python_calls_on_the_service(fusion, tmp_path):
    """`grpo_llm.py --env tools --tools python --tool-sandbox remote` from a tiny agent's folder (fine-tuned to call
    the Python tool with print(1+1), then answer): every call runs on the local SandboxFusion server, none fails, and
    the answers after the tool's result score."""

    from chat_formats import sum_task, tiny_chat_model, tool_agent
    from conftest import only_run, read_metrics, run_script

    call = {"name": "python", "arguments": {"code": "print(1+1)"}}
    agent = tool_agent("llama3.1", tiny_chat_model(tmp_path / "init", "llama3.1"), tmp_path / "agent", call=call)
    data, reward = sum_task(tmp_path)
    run_script("grpo_llm.py", "--model-name-or-path", agent, "--train-files", data, "--reward-fn",
               f"{reward}:compute_score", "--env", "tools", "--tools", "python", "--tool-sandbox", "remote",
               "--tool-sandbox-url", fusion.url, "--max-turns", 3, "--max-new-tokens", 40, "--total-steps", 1,
               "--num-prompts", 2, "--group-size", 2, "--mini-batch-size", 4, "--micro-batch-size", 4,
               "--eval-every", 0, "--mixed-precision", "no", "--output-dir", tmp_path / "run")  # fmt: skip
    (m,) = read_metrics(only_run(tmp_path / "run"))
    assert m["env/tool_call_rate"] == 1.0 and m["env/tool_success_rate"] == 1.0, m
    assert m["env/tool_service_errors"] == 0.0 and m["train/reward"] > 0.5, m
    codes = [r["body"]["code"] for r in fusion.requests]
    assert codes.count("print(1+1)") >= 4 and set(codes) <= {"print('ok')", "print(1+1)"}, codes  # (start-up checks)
