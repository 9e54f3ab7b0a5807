"""--tool-sandbox remote (common/integrations/sandbox_service.py) against a local server speaking SandboxFusion's API
(tests/helpers/sandbox_fusion_server.py: the sandbox-fusion package's own request and answer models): the code runs there,
each call is bounded, a failing service is retried then counted (the run goes on), its key is sent to it and never
across a redirect, and a run with no service there stops at start-up with one line."""

import time
from functools import partial
from types import SimpleNamespace

import pytest

from common.core.errors import UserError
from common.integrations import sandbox_service
from common.integrations.builtin_envs import ToolEnv
from common.integrations.sandbox_service import SandboxServiceError, check_service, run_remote
from sandbox_fusion_server import FusionServer


def test_the_code_runs_on_the_service_with_its_limits_and_output(fusion):
    assert run_remote("print(6 * 7)", fusion.url) == ("42", True)
    out, ok = run_remote("raise ValueError('bad')", fusion.url + "/run_code")  # the endpoint itself works too
    assert not ok and "ValueError: bad" in out
    out, ok = run_remote("while True: pass", fusion.url, timeout=1.0)
    assert not ok and out == "[timed out after 1.0 s]", out
    out, ok = run_remote("print('x' * 5000)", fusion.url, max_chars=100)
    assert ok and out.count("x") == 100 and out.endswith("[output truncated]")
    body = fusion.requests[2]["body"]
    assert body == {"code": "while True: pass", "language": "python", "run_timeout": 1.0, "memory_limit_MB": 512}
    assert {r["path"] for r in fusion.requests} == {"/run_code"}


def test_a_failing_service_is_retried_then_raises_and_a_hung_one_is_bounded(fusion, monkeypatch):
    fusion.fail_first = 1  # one 500, then an answer: the retry gets it
    assert run_remote("print(1)", fusion.url) == ("1", True) and len(fusion.requests) == 2
    fusion.mode = "500"
    with pytest.raises(SandboxServiceError, match="no valid answer after 2 tries .*HTTP 500"):
        run_remote("print(1)", fusion.url)
    fusion.mode = "sandbox_error"  # the service's own fault, answered: not retried, raised
    with pytest.raises(SandboxServiceError, match="the sandbox failed: executor pod lost"):
        run_remote("print(1)", fusion.url)
    fusion.mode = "hang"
    monkeypatch.setattr(sandbox_service, "SLACK_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(SandboxServiceError, match="timed out"):
        run_remote("print(1)", fusion.url, timeout=0.5)
    assert time.monotonic() - t0 < 4.0  # two tries of 1 s each and a 0.5 s backoff, not the server's 30 s


def test_the_key_goes_to_the_service_and_never_across_a_redirect(fusion, monkeypatch):
    monkeypatch.setenv("SANDBOX_FUSION_API_KEY", "sf_secret_value")
    run_remote("print(1)", fusion.url)
    assert fusion.requests[-1]["headers"]["Authorization"] == "Bearer sf_secret_value"
    elsewhere = FusionServer()
    try:
        fusion.mode = f"redirect:{elsewhere.url}/run_code"
        with pytest.raises(SandboxServiceError, match="redirect .*refusing to follow it"):
            run_remote("print(1)", fusion.url)
        assert elsewhere.requests == []  # nothing, the key least of all, went to the other address
    finally:
        elsewhere.close()


def test_the_tool_environment_counts_service_failures_and_goes_on(fusion):
    env = ToolEnv(("python",), sandbox="remote", sandbox_url=fusion.url)
    env.tool_format = "hermes"
    env.reset(SimpleNamespace(messages=[{"role": "user", "content": "q"}], text="q"))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(2 + 3)"}}</tool_call>'
    step = env.step(call, [])
    assert step.observation[0]["content"] == "5" and step.info["tool_service_errors"] == 0
    assert step.info["tool_errors"] == 0
    fusion.mode = "500"
    step = env.step(call, [])
    assert step.info["tool_service_errors"] == 1 and step.info["tool_errors"] == 1 and not step.done
    assert step.observation[0]["content"].startswith("error: the code could not be run")


def test_no_service_there_is_one_line_at_start_up(fusion):
    port = fusion.httpd.server_port
    fusion.close()  # nothing listens there now
    for url, match in [(f"http://127.0.0.1:{port}", f"--tool-sandbox remote: http://127.0.0.1:{port}/run_code"),
                       ("", "--tool-sandbox-url '': expected the SandboxFusion server's")]:  # fmt: skip
        check_service.cache_clear()
        with pytest.raises(UserError, match=match) as e:
            partial(ToolEnv, ("python",), sandbox="remote", sandbox_url=url)()
        assert "\n" not in str(e.value)
    check_service.cache_clear()
