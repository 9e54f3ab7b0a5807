"""The built-in environments of `--env`: `tools` (`ToolEnv`: the calculator and the Python tool,
common.integrations.sandbox, or a SandboxFusion service) and `feedback` (`FeedbackEnv`: a second try after a wrong
answer); `load_env_class` resolves `--env tools | feedback | path/to/file.py:ClassName`.
"""

from __future__ import annotations

import json
import time

from common.core.chat import TOOL_SCHEMAS, TOOL_STOPS, parse_tool_calls
from common.core.envs import Environment, Step
from common.core.errors import UserError, load_from_file
from common.integrations.sandbox import calculator, check_sandbox, run_python
from common.integrations.sandbox_service import SandboxServiceError, check_service, run_remote


def _with_system(messages, text: str) -> list[dict]:
    """`messages` (a string: one user message) with `text` appended to its system message, or a system message
    first."""
    msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    if msgs and msgs[0]["role"] == "system":
        msgs[0]["content"] = f"{msgs[0]['content']}\n\n{text}"
        return msgs
    return [{"role": "system", "content": text}] + msgs


class ToolEnv(Environment):
    """Tools for the policy: it calls them in the chat template's format (`tool_format`, resolve_tool_format:
    Hermes/Qwen `<tool_call>` or Llama 3.x JSON, the tools listed by the template's own tools= rendering) or, where
    the template renders no tools, with `<tool_call>{json}</tool_call>` (the protocol below, in the system message);
    gets the results (`tool` messages the template renders, or `<tool_response>` blocks in a user message), and ends
    with an answer (a turn without a tool call), scored by the run's reward. A malformed call or an unknown tool gets
    an error observation. A call on the last turn is not run: that turn is scored as the answer."""

    # per trajectory: calls, failed calls, seconds; the first call (0/1), the final answer (0/1) and whether a tool
    # result came before it (0/1): tool_metrics turns their batch means into the rates of tool learning
    info_keys = ("tool_calls", "tool_errors", "tool_s", "tool_used", "answered", "answer_after_tool")
    info_keys += ("tool_service_errors",)  # calls the sandbox service (--tool-sandbox remote) failed to run
    parses_tool_calls = True  # Episodes refuses a template whose tool-call format the parser does not know
    PROTOCOL = (
        'You can use tools. To call one, write <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call> and '
        "stop; its result comes back as <tool_response>...</tool_response>. Tools:\n{tools}\n"
        "For example: <tool_call>{example}</tool_call>\nWhen you know the answer, reply without a tool call."
    )
    EXAMPLES = {"calculator": {"expression": "12 * (3 + 4)"}, "python": {"code": "print(sum(range(10)))"}}
    CODE_PROTOCOL = (  # --tool-format code (ReTool's protocol): the Python tool only
        "You can run Python: write a program between <code> and </code> that prints what you need, and stop; its "
        "output comes back as <output>...</output>. For example: <code>\nprint(sum(range(10)))\n</code>\n"
        "When you know the answer, reply without code."
    )

    def __init__(
        self,
        tools=("calculator", "python"),
        timeout=5.0,
        memory_mb=512,
        max_chars=1000,
        call_cost=0.0,
        sandbox="namespaces",
        sandbox_url="",
    ):
        unknown = sorted(set(tools) - set(TOOL_SCHEMAS))
        if unknown:
            raise UserError(f"--tools {','.join(tools)}: unknown tool(s) {unknown}; known: {sorted(TOOL_SCHEMAS)}")
        self.tools = [TOOL_SCHEMAS[t] for t in tools]
        self.python = dict(timeout=timeout, memory_mb=memory_mb, max_chars=max_chars)
        self.sandbox, self.sandbox_url = sandbox, sandbox_url
        if "python" in tools and sandbox == "remote":
            check_service(sandbox_url)  # no service there: one line now, not a failed call per trajectory
        elif "python" in tools:
            check_sandbox(sandbox)  # where the kernel refuses namespaces: one line naming --tool-sandbox, now
        self.service_errors = 0
        self.call_cost, self.had_result = call_cost, False

    @staticmethod
    def stop_strings(tool_format: str) -> list[str]:
        """Where a model turn stops before its EOS (Episodes): at the call's closing tag, for --tool-format code."""
        return TOOL_STOPS.get(tool_format, [])

    def reset(self, row):
        if self.tool_format == "code":
            return _with_system(super().reset(row), self.CODE_PROTOCOL)
        if self.tool_format != "text":  # the template lists the tools and says how to call them
            return super().reset(row)
        listing = "\n".join(f"- {t['function']['name']}: {json.dumps(t['function']['parameters'])}" for t in self.tools)
        name = self.tools[0]["function"]["name"]
        example = json.dumps({"name": name, "arguments": self.EXAMPLES[name]})
        return _with_system(super().reset(row), self.PROTOCOL.format(tools=listing, example=example))

    def run_tool(self, call: dict) -> tuple[str, bool]:
        """(the tool's output, ok)."""
        name, a = call["name"], call["arguments"]
        if name not in [t["function"]["name"] for t in self.tools]:
            return f"error: unknown tool {name!r}", False
        key = "expression" if name == "calculator" else "code"
        if not isinstance(a.get(key), str):
            return f"error: {name} needs a string argument {key!r}", False
        if name == "calculator":
            out = calculator(a[key])
            return out, not out.startswith("error")
        if self.sandbox != "remote":
            return run_python(a[key], sandbox=self.sandbox, **self.python)
        try:
            return run_remote(a[key], self.sandbox_url, **self.python)
        except SandboxServiceError as e:  # counted; the model sees a failed call and the run goes on
            self.service_errors += 1
            return f"error: the code could not be run ({str(e)[:200]})", False

    def step(self, text, ids):
        calls = parse_tool_calls(text, self.tool_format)
        if not calls or self.final:  # an answer (or no turn left to read a tool's result)
            return Step(None, self.score(text), True, {"answered": 1, "answer_after_tool": float(self.had_result)})
        t0, outputs, errors = time.time(), [], 0
        for call in calls:
            out, ok = (call, False) if isinstance(call, str) else self.run_tool(call)
            errors += not ok
            outputs.append(out)
        info = {"tool_calls": len(calls), "tool_errors": errors, "tool_s": time.time() - t0}
        info["tool_service_errors"], self.service_errors = self.service_errors, 0
        info["tool_used"] = float(not self.had_result)  # counted once per trajectory
        self.had_result = True
        if self.tool_format in ("text", "code"):  # our protocols: the results in one user message
            tag = "output" if self.tool_format == "code" else "tool_response"
            results = [{"role": "user", "content": "\n".join(f"<{tag}>{o}</{tag}>" for o in outputs)}]
        else:  # a `tool` message per call: the template renders them (<tool_response> blocks, an ipython turn)
            results = [{"role": "tool", "content": o} for o in outputs]
        return Step(results, -self.call_cost * len(calls), False, info)


class FeedbackEnv(Environment):
    """A second try: the run's reward judges each answer; a wrong one gets `feedback` and another turn, up to
    --max-turns. The reward is the last answer's score, minus `turn_cost` per turn after the first."""

    info_keys = ("solved_turn",)

    def __init__(self, feedback="Your answer is incorrect. Please try again.", turn_cost=0.0):
        self.feedback, self.turn_cost = feedback, turn_cost

    def step(self, text, ids):
        r = self.score(text)
        if r >= 1 or self.final:
            return Step(None, r - self.turn_cost * (self.turn - 1), True, {"solved_turn": self.turn if r >= 1 else 0})
        return Step([{"role": "user", "content": self.feedback}], 0.0, False)


BUILTIN = {"tools": ToolEnv, "feedback": FeedbackEnv}


def load_env_class(spec: str):
    """`tools` | `feedback` | `path/to/file.py:ClassName` -> the class (the file imported only when asked)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise UserError(f"--env {spec!r}: expected {' or '.join(BUILTIN)} or path/to/file.py:ClassName")
    cls = load_from_file(spec, "--env", "class")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise UserError(f"--env {spec!r}: {cls!r} is not a class with reset(row) and step(text, ids)")
    return cls
