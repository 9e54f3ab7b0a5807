"""Environments (common/core/envs.py, common/integrations/sandbox.py): the Python tool's guarantees, tool-call parsing,
token in / token out over several turns (the trainer scores exactly the sampled ids), observation tokens out of every
loss, and failures of user environments bounded."""

import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from common.core import chat
from common.core import models as M
from common.core.chat import parse_tool_calls
from common.core.data import PromptRow
from common.core.envs import Environment, Episodes, Step
from common.core.errors import UserError
from common.core.forwards import forward_logprobs
from common.core.generation import sequence_attention_mask
from common.integrations.builtin_envs import FeedbackEnv, ToolEnv, load_env_class
from common.integrations.sandbox import calculator, run_python
from shared_envs import REPO, THINK_DROPPING_TEMPLATE, Returns, ScriptedEngine, StoppingEngine, _rows, _score

sys.path.insert(0, str(REPO / "algos"))


def _check_token_in_token_out(ro, engine_contexts=None):
    """For each trajectory: every turn's sampler context is the prompt + everything before it in the trained row, and
    its sampled ids sit in the trained row at that place with mask 1; every other position has mask 0."""
    for i, turns in enumerate(ro.turn_ids):
        q = ro.queries[i][ro.query_mask[i].bool()].tolist()
        resp = ro.responses[i].tolist()
        model_pos = set()
        for ctx, new in turns:
            assert ctx[: len(q)] == q
            start = len(ctx) - len(q)
            assert resp[:start] == ctx[len(q) :], "the sampler saw what the trainer scores before this turn"
            assert resp[start : start + len(new)] == new, "the trainer scores the sampled ids"
            model_pos |= set(range(start, start + len(new)))
        mask = ro.response_mask[i].tolist()
        assert all((mask[t] == 1) == (t in model_pos) for t in range(len(mask)))
        if engine_contexts is not None:
            assert all(ctx in engine_contexts for ctx, _ in turns)


class PaysEachTurn(Environment):
    """Reward 1 for the first answer (with another question), 10 for the second (done)."""

    def step(self, text, ids):
        if self.turn == 1:
            return Step([{"role": "user", "content": "and again?"}], reward=1.0)
        return Step(None, reward=10.0, done=True)


# ------------------------------------------------------------------ user environments: loaded by path, failures bounded
class Raises(Environment):
    def step(self, text, ids):
        raise RuntimeError("env bug")


class Hangs(Environment):
    def step(self, text, ids):
        while True:
            pass


class Exits(Environment):
    def reset(self, row):
        sys.exit(3)


class Moves(Environment):
    def step(self, text, ids):
        os.chdir("/")
        return Step(None, 1.0, True)


WRONG = [("reset", None), ("reset", 3), ("reset", []), ("reset", [{"role": "user", "content": 5}]),
         ("step", None), ("step", "done"), ("step", ([], 1.0, True, {})), ("reward", None), ("reward", "1"),
         ("reward", torch.ones(2)), ("reward", float("nan")), ("info", [1]), ("info", {"tool_calls": "x"}),
         ("observation", "just text"), ("observation", [{"role": "user", "content": None}])]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_loaded(tiny):
    """(tokenizer, model) of the tiny model, loaded once for the module's many short trajectories."""
    tok = chat.load_tokenizer(tiny)
    return tok, M.load_causal_lm(tiny, tok)


# ------------------------------------------------------------------ the Python tool: each guarantee of its docstring
def test_python_tool_runs_code_and_returns_its_output():
    out, ok = run_python("print(6 * 7)")
    assert ok and out == "42"
    out, ok = run_python("raise ValueError('bad')")
    assert not ok and "ValueError: bad" in out


def test_python_tool_wall_clock_timeout():
    t0 = time.time()
    out, ok = run_python("import time\nwhile True: time.sleep(0.01)", timeout=1.0)
    assert not ok and "timed out" in out and time.time() - t0 < 5


def test_python_tool_cpu_limit_is_set():
    out, ok = run_python("import resource; print(resource.getrlimit(resource.RLIMIT_CPU))", timeout=3.0)
    assert ok and out == "(4, 4)"  # timeout + 1 s of CPU


def test_python_tool_memory_limit():
    out, ok = run_python("x = bytearray(600 * 2**20)\nprint('allocated')", memory_mb=256)
    assert not ok and "MemoryError" in out and "allocated" not in out
    out, ok = run_python("x = bytearray(50 * 2**20)\nprint('allocated')", memory_mb=256)
    assert ok and out == "allocated"


def test_python_tool_sees_no_secret_of_the_trainer(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_value")
    out, ok = run_python("import os; print(sorted(os.environ.items()))")
    assert ok and "secret_value" not in out and "HF_TOKEN" not in out and "WANDB" not in out


@pytest.mark.parametrize("sandbox", ["namespaces", "audit"])
def test_python_tool_writes_only_in_its_own_directory(tmp_path, sandbox):
    target = tmp_path / "outside.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import pathlib; pathlib.Path({str(target)!r}).write_text('x')",
        "open('../escape.txt', 'w').write('x')",
    ):
        out, ok = run_python(code, sandbox=sandbox)  # (namespaces: the path does not exist in its view, or the hook)
        assert not ok and ("sandbox" in out or sandbox == "namespaces" and "Error" in out), (code, out)
    assert not target.exists()
    (tmp_path / "keep.txt").write_text("mine")
    out, ok = run_python(f"import os; os.remove({str(tmp_path / 'keep.txt')!r})", sandbox=sandbox)
    assert not ok and (tmp_path / "keep.txt").read_text() == "mine"
    # inside its directory: allowed, and the directory is private (empty at start, gone after)
    code = "import os; print(os.listdir('.')); open('a.txt', 'w').write('1'); print(os.getcwd())"
    out, ok = run_python(code, sandbox=sandbox)
    assert ok and out.splitlines()[0] == "[]", out
    if sandbox == "audit":  # a host directory, deleted after the call
        assert not Path(out.splitlines()[1]).exists()
    else:  # its own tmpfs, seen by nobody else and gone with its mount namespace
        assert out.splitlines()[1] == "/work" and run_python(code)[0].splitlines()[0] == "[]"


@pytest.mark.parametrize("sandbox", ["namespaces", "audit"])
def test_python_tool_starts_no_process_and_opens_no_socket(sandbox):
    for code in ("import subprocess; subprocess.run(['true'])", "import os; os.system('true')", "import socket"):
        out, ok = run_python(code, sandbox=sandbox)
        assert not ok and "sandbox" in out, (code, out)


def test_python_tool_output_is_truncated():
    out, ok = run_python("print('x' * 10**7)", max_chars=500)
    assert out.count("x") == 500 and "[output truncated]" in out
    out, ok = run_python("while True: print('y' * 1000)", timeout=2.0, max_chars=100)  # a printing loop: capped file
    assert out.count("y") == 100


def test_calculator():
    assert calculator("12 * (3 + 4)") == "84" and calculator("7 / 2") == "3.5" and calculator("2^10") == "1024"
    assert calculator("1/0").startswith("error") and calculator("9**9**9").startswith("error")
    assert calculator("__import__('os').system('true')").startswith("error")


def test_parse_tool_calls():
    ok = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    assert parse_tool_calls("let me " + ok) == [{"name": "calculator", "arguments": {"expression": "2+2"}}]
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert parse_tool_calls(as_string) == [{"name": "python", "arguments": {"code": "print(1)"}}]
    assert parse_tool_calls("the answer is 4") == []
    for bad in ("<tool_call>{calculator: 2+2}</tool_call>", '<tool_call>{"name": "x"', "<tool_call>[1]</tool_call>"):
        (call,) = parse_tool_calls(bad)
        assert isinstance(call, str) and call.startswith("error"), bad


def test_tool_environment_rollout_keeps_sampled_ids(tiny):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)

    def reply(ctx):
        if "<tool_response>42" not in ctx:  # (the system prompt names <tool_response> too)
            return 'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        return "The answer is 42."

    engine = ScriptedEngine(tok, reply)
    eps = Episodes(partial(ToolEnv, ("calculator",)), tok, _score, max_turns=3, max_tokens=200, timeout=10)
    ro = eps.run(model, _rows(), seeds=[1, 2], engine=engine)
    _check_token_in_token_out(ro, engine.contexts)
    assert ro.scores.tolist() == [1.0, 1.0] and ro.stats["env/turns"].tolist() == [2, 2]
    assert ro.stats["env/tool_calls"].tolist() == [1, 1] and ro.stats["env/tool_errors"].tolist() == [0, 0]
    assert (ro.stats["perf/tool_s"] > 0).all()
    assert "<tool_response>42</tool_response>" in ro.transcripts[0] and "You can use tools" in ro.transcripts[0]
    assert not ro.truncated.any() and (ro.stats["env/obs_frac"] > 0).all()
    # the observation is the template's own rendering of the message after the model's EOS: "\n<|im_start|>user ..."
    obs = tok.decode(ro.responses[0][(ro.response_mask[0] == 0) & (ro.responses[0] != tok.pad_token_id)])
    assert obs.startswith("\n<|im_start|>user\n<tool_response>42") and obs.endswith("<|im_start|>assistant\n")


def test_malformed_and_unknown_tool_calls_get_error_observations(tiny):
    tok = chat.load_tokenizer(tiny)
    replies = iter(
        ["<tool_call>{not json}</tool_call>", '<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "42"]
    )
    engine = ScriptedEngine(tok, lambda ctx: next(replies))
    eps = Episodes(partial(ToolEnv, ("calculator",)), tok, _score, max_turns=3, max_tokens=300, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=engine)
    assert "not valid JSON" in ro.transcripts[0] and "unknown tool 'shell'" in ro.transcripts[0]
    assert ro.stats["env/tool_errors"].item() == 2 and ro.scores.item() == 1.0
    _check_token_in_token_out(ro)


def test_feedback_environment_gives_another_turn(tiny):
    tok = chat.load_tokenizer(tiny)
    engine = ScriptedEngine(tok, lambda ctx: "41" if ctx.count("<|im_start|>assistant") == 1 else "42")
    eps = Episodes(partial(FeedbackEnv, turn_cost=0.1), tok, _score, max_turns=3, max_tokens=100, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(), seeds=[0, 1], engine=engine)
    assert ro.stats["env/turns"].tolist() == [2, 2] and ro.stats["env/solved_turn"].tolist() == [2, 2]
    assert ro.scores.tolist() == pytest.approx([0.9, 0.9]) and "incorrect" in ro.transcripts[1]
    _check_token_in_token_out(ro)
    # never right: --max-turns answers, then the last one's score
    eps = Episodes(FeedbackEnv, tok, _score, max_turns=3, max_tokens=100, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=ScriptedEngine(tok, lambda ctx: "0"))
    assert ro.stats["env/turns"].item() == 3 and ro.scores.item() == 0 and not ro.truncated.any()


def test_budgets_mark_trajectories_truncated(tiny):
    tok = chat.load_tokenizer(tiny)
    engine = ScriptedEngine(tok, lambda ctx: "wrong answer " * 3)
    eps = Episodes(FeedbackEnv, tok, _score, max_turns=5, max_tokens=30, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=engine)
    assert ro.truncated.all() and ro.response_mask.shape[1] <= 30
    _check_token_in_token_out(ro)
    # a turn cut by --max-new-tokens ends the trajectory, truncated
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=engine, max_new_tokens=4)
    assert ro.truncated.all() and ro.stats["env/turns"].item() == 1 and ro.response_mask.sum() == 4


def test_a_template_that_rewrites_earlier_turns_does_not_change_what_is_scored(tiny):
    tok = chat.load_tokenizer(tiny)
    tok.chat_template = THINK_DROPPING_TEMPLATE  # as Qwen3's and DeepSeek-R1's templates drop past reasoning
    engine = ScriptedEngine(tok, lambda ctx: "<think>six sevens</think>41" if "incorrect" not in ctx else "42")
    eps = Episodes(FeedbackEnv, tok, _score, max_turns=2, max_tokens=100, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(1), seeds=[0], engine=engine)
    _check_token_in_token_out(ro)
    trained = tok.decode(ro.query_responses[0][ro.query_responses[0] != tok.pad_token_id])
    assert "<think>six sevens</think>41" in trained  # the first turn as sampled, reasoning included
    # re-rendering the conversation (what token drift comes from) would have trained on other tokens
    conv = _rows(1)[0].messages + [
        {"role": "assistant", "content": "<think>six sevens</think>41"},
        {"role": "user", "content": FeedbackEnv().feedback},
        {"role": "assistant", "content": "42"},
    ]
    assert "six sevens" not in tok.apply_chat_template(conv, tokenize=False)


def test_hf_sampler_turns_are_scored_on_their_own_ids_and_logprobs(tiny):
    """The real decoding loop (no engine): the trainer's forward over the assembled rows gives the sampler's own
    log-probs on every model token, turn after turn (observations in between are attended, never scored)."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok).eval()
    eos_bias = lambda module, inputs, logits: logits.index_add(
        -1, torch.tensor([tok.eos_token_id]), logits[..., :1] * 0 + 9
    )
    model.lm_head.register_forward_hook(eos_bias)  # turns of a few tokens: EOS ~ 1 in 5
    eps = Episodes(FeedbackEnv, tok, _score, max_turns=3, max_tokens=60, timeout=10)
    ro = eps.run(model, _rows(3), seeds=[5, 6, 7], max_new_tokens=12)
    _check_token_in_token_out(ro)
    assert (
        ro.stats["env/turns"].max() > 1 and (ro.response_mask == 0).logical_and(ro.responses != tok.pad_token_id).any()
    )
    attn = sequence_attention_mask(ro.query_mask, ro.responses.shape[1])
    with torch.no_grad():
        lp = forward_logprobs(model, ro.query_responses, attn, ro.queries.shape[1]) * ro.response_mask
    assert (lp - ro.logprobs).abs().max() < 1e-4
    # the first turn is the one-turn rollout of the same seed (a --max-turns 1 run samples what plain GRPO samples)
    one = Episodes(FeedbackEnv, tok, _score, max_turns=1, max_tokens=60, timeout=10)
    first = one.run(model, _rows(3), seeds=[5, 6, 7], max_new_tokens=12)
    for i in range(3):
        n = len(first.turn_ids[i][0][1])
        assert ro.turn_ids[i][0][1] == first.turn_ids[i][0][1] and torch.equal(
            first.responses[i, :n], ro.responses[i, :n]
        )


def test_observation_tokens_get_no_gradient(tiny):
    """The GRPO loss (each --loss-agg), its KL term and entropy on a multi-turn batch: zero gradient on observation
    positions, non-zero on model tokens."""
    import grpo_llm as G

    from common.core.ops import kl_estimate

    tok = chat.load_tokenizer(tiny)
    engine = ScriptedEngine(tok, lambda ctx: "41" if ctx.count("<|im_start|>assistant") == 1 else "42")
    eps = Episodes(FeedbackEnv, tok, _score, max_turns=2, max_tokens=100, timeout=10)
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(2), seeds=[0, 1], engine=engine)
    mask = ro.response_mask  # (B, T)
    obs = (mask == 0) & (ro.responses != tok.pad_token_id)
    assert obs.any()
    g = torch.Generator().manual_seed(0)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        for loss_type in ("grpo", "cispo", "sapo"):
            new = torch.randn(mask.shape, generator=g).requires_grad_()
            # ratios near 1: no token clipped (a clipped token's zero gradient is the clip's, not the mask's)
            old, adv = new.detach() + 0.01 * torch.randn(mask.shape, generator=g), torch.tensor([[1.0], [-0.5]])
            ref = torch.randn(mask.shape, generator=g)
            fn = {"grpo": lambda: G.grpo_loss(new, old, adv, mask, 0.2, 0.2), "cispo": lambda: G.cispo_loss(new, old, adv, mask, 4.0),
                  "sapo": lambda: G.sapo_loss(new, old, adv, mask, 1.0, 1.05)}[loss_type]  # fmt: skip
            token_loss, _ = fn()
            total = G.aggregate(token_loss, mask, agg, mask.sum(), 2, 48)
            total = total + G.aggregate(kl_estimate(new, ref, "k3"), mask, agg, mask.sum(), 2, 48)
            total.backward()
            assert (new.grad[obs] == 0).all() and (new.grad[mask.bool()] != 0).all(), (agg, loss_type)
    new = torch.randn(mask.shape, generator=g).requires_grad_()
    token_loss, _ = G.gspo_loss(new, new.detach() * mask, torch.tensor([[1.0], [-0.5]]), mask, 0.2, 0.2)
    G.aggregate(token_loss, mask, "token-mean", mask.sum(), 2, 48).backward()
    assert (new.grad[obs] == 0).all() and (new.grad[mask.bool()] != 0).all()


def test_ppo_credits_each_turns_reward_to_its_own_turn(tiny):
    """PPO's per-token rewards (Rollout.token_scores) with --env: each step's reward on the last model token of its
    own turn, what the score adds beyond them (a missing-EOS penalty) on the last; GAE (gamma 0.9, lam 1, values 0)
    then gives turn 1's tokens 1 + 0.9^k * 10 and turn 2's only their own: against a loop over the model tokens.
    (Before: the whole 11 on turn 2's last token, so turn 1's tokens were credited with turn 2's reward.)"""
    from common.core.ops import gae
    from common.core.sampling import sample

    tok = chat.load_tokenizer(tiny)
    engine = ScriptedEngine(tok, lambda ctx: "41" if ctx.count("<|im_start|>assistant") == 1 else "42")
    eps = Episodes(PaysEachTurn, tok, _score, max_turns=3, max_tokens=100, timeout=10)
    ro = sample(M.load_causal_lm(tiny, tok), tok, _rows(2), None, eps, "cpu", [0, 1], engine)
    assert ro.scores.tolist() == [11.0, 11.0]
    scores = ro.scores - torch.tensor([0.0, 0.5])  # a penalty on row 1
    per_token = ro.token_scores(scores)  # (B, T)
    for i in range(2):
        model = ro.mask[i].nonzero()[:, 0].tolist()  # positions of the model's tokens, in order
        obs_start = next(t for t in range(model[0], model[-1]) if ro.mask[i, t] == 0)  # the observation after turn 1
        turn1_last, last = obs_start - 1, model[-1]
        want = torch.zeros_like(per_token[i])
        want[turn1_last], want[last] = 1.0, 10.0 - (0.5 if i else 0.0)
        assert torch.equal(per_token[i], want), i
        ret, loop = 0.0, {}
        for t in reversed(model):  # GAE over the model's tokens only (observations skipped), values 0, lam 1
            ret = float(per_token[i, t]) + 0.9 * ret
            loop[t] = ret
        adv, _ = gae(per_token[i : i + 1], torch.zeros(1, per_token.shape[1]), ro.mask[i : i + 1], 0.9, 1.0)
        assert all(abs(float(adv[0, t]) - v) < 1e-5 for t, v in loop.items())
        assert float(adv[0, turn1_last]) == pytest.approx(1.0 + 0.9 * loop[model[model.index(turn1_last) + 1]])


@pytest.mark.parametrize("workers", [False, True], ids=["in-process", "workers"])
def test_failing_or_hanging_environments_are_counted_not_fatal(tiny, workers):
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)
    engine = ScriptedEngine(tok, lambda ctx: "42")
    logs = []
    for cls in (Raises, Hangs, Exits):
        eps = Episodes(cls, tok, _score, max_turns=2, max_tokens=50, timeout=0.5, log=logs.append, workers=workers)
        t0 = time.time()
        ro = eps.run(model, _rows(2), seeds=[0, 1], engine=engine)
        assert time.time() - t0 < 10 and ro.scores.tolist() == [0, 0] and ro.stats["env/errors"].tolist() == [1, 1]
        assert eps.errors == 2
        eps.close()
    timeout = "no answer in 0.5 s (--env-timeout; its process killed)" if workers else "RewardTimeout"
    assert any("env bug" in x for x in logs) and any(timeout in x for x in logs), logs


@pytest.mark.parametrize("env", ["tools", "feedback"])
def test_environments_in_workers_give_what_they_give_in_process(tiny, env):
    """The same trajectories, ids, masks and scores with the environments in worker processes: the tool environment
    (its sandboxed Python from inside the worker) and the feedback environment (its score() asked of the trainer)."""
    tok = chat.load_tokenizer(tiny)
    model = M.load_causal_lm(tiny, tok)

    def reply(ctx):
        if env == "feedback":
            return "41" if ctx.count("<|im_start|>assistant") == 1 else "42"
        if "<tool_response>42" not in ctx:
            return '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'
        return "The answer is 42."

    factory = partial(ToolEnv, ("python",)) if env == "tools" else partial(FeedbackEnv, turn_cost=0.1)
    out = []
    for workers in (False, True):
        eps = Episodes(factory, tok, _score, max_turns=3, max_tokens=200, timeout=20, workers=workers)
        out.append(eps.run(model, _rows(2), seeds=[1, 2], engine=ScriptedEngine(tok, reply)))
        eps.close()
    a, b = out
    assert torch.equal(a.responses, b.responses) and torch.equal(a.response_mask, b.response_mask)
    assert a.scores.tolist() == b.scores.tolist() and b.stats["env/errors"].tolist() == [0, 0]
    assert b.stats["env/turns"].tolist() == [2, 2] and b.scores.tolist() == pytest.approx(
        [1.0, 1.0] if env == "tools" else [0.9, 0.9]
    )
    _check_token_in_token_out(b)


@pytest.mark.parametrize("where, what", WRONG, ids=[f"{w}-{str(x)[:12]}" for w, x in WRONG])
def test_an_environment_returning_the_wrong_thing_is_a_counted_failure(tiny_loaded, where, what):
    """Each wrong return (a reset that is not messages, a step that is not a Step, a reward that is not a finite
    number, info that is not a dict of numbers, an observation that is not messages) ends that trajectory with
    reward 0, counted in env/errors with the first message printed (naming what was returned); the run goes on."""
    tok, model = tiny_loaded
    logs = []
    eps = Episodes(partial(Returns, where, what), tok, _score, max_turns=2, max_tokens=50, timeout=5, log=logs.append)
    ro = eps.run(model, _rows(2), seeds=[0, 1], engine=ScriptedEngine(tok, lambda ctx: "42"))
    assert ro.stats["env/errors"].tolist() == [1, 1] and eps.errors == 2 and ro.scores.tolist() == [0, 0]
    assert len(logs) == 1 and f"environment {where if where == 'reset' else 'step'} failed: returned" in logs[0], logs


def test_an_environment_that_changes_the_working_directory_is_put_back(tiny_loaded):
    tok, model = tiny_loaded
    logs, cwd = [], os.getcwd()
    eps = Episodes(Moves, tok, _score, max_turns=2, max_tokens=50, timeout=5, log=logs.append)
    ro = eps.run(model, _rows(2), seeds=[0, 1], engine=ScriptedEngine(tok, lambda ctx: "42"))
    assert os.getcwd() == cwd and ro.stats["env/errors"].tolist() == [1, 1] and "working directory" in logs[0]


def test_env_flag_loads_user_classes_and_refuses_bad_specs(tmp_path):
    f = tmp_path / "my_env.py"
    f.write_text(
        "from common.core.envs import Environment, Step\n"
        "class Guess(Environment):\n"
        "    def step(self, text, ids):\n"
        "        return Step(None, float(len(text) < 5), True)\n"
    )
    cls = load_env_class(f"{f}:Guess")
    assert cls.__name__ == "Guess" and issubclass(cls, Environment)
    assert load_env_class("tools") is ToolEnv and load_env_class("feedback") is FeedbackEnv
    for spec, says in [
        (f"{f}:Nope", "has no class 'Nope'"),
        ("missing.py:X", "not found"),
        ("bogus", "expected tools or feedback"),
    ]:
        with pytest.raises(UserError, match=says):
            load_env_class(spec)
    (tmp_path / "broken.py").write_text("import not_installed_module_xyz\n")
    with pytest.raises(UserError, match="failed to import: ModuleNotFoundError"):
        load_env_class(f"{tmp_path / 'broken.py'}:X")
    with pytest.raises(UserError, match="unknown tool"):
        ToolEnv(("calculator", "browser"))


def test_step_defaults():
    s = Step()
    assert s.observation is None and s.reward == 0 and not s.done and s.info == {}
    assert json.dumps(s.info) == "{}"


def test_the_environment_written_in_the_docs_runs(tiny, tmp_path):
    """docs/agents.md's 20-line environment, as a user copies it: a number game with hints."""
    import re

    code = re.search(r"```python\n(.*?)```", (REPO / "docs/agents.md").read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) <= 22
    (tmp_path / "guess.py").write_text(code)
    cls = load_env_class(f"{tmp_path / 'guess.py'}:Guess")
    tok = chat.load_tokenizer(tiny)
    guesses = iter(["50", "25", "hmm", "37"])
    engine = ScriptedEngine(tok, lambda ctx: next(guesses))
    row = PromptRow(text="", data_source="x", ground_truth="37", messages=None)
    ro = Episodes(cls, tok, _score, max_turns=4, max_tokens=200, timeout=10).run(
        M.load_causal_lm(tiny, tok), [row], seeds=[0], engine=engine
    )
    assert ro.stats["env/turns"].item() == 4 and ro.stats["env/hints"].item() == 2
    assert ro.scores.item() == pytest.approx(0.9) and "lower" in ro.transcripts[0] and "higher" in ro.transcripts[0]
    _check_token_in_token_out(ro)


def test_the_code_protocol_stops_at_the_closing_tag_and_the_trainer_sees_the_turn_end(tiny):
    """--tool-format code (issue 68): the system message asks for <code>...</code>; the turn stops at </code> (what
    the reply wrote after it is never sampled), the template's turn end follows it as the model's token (mask 1,
    sampler log-prob 0), the program's output comes back as <output>, and the next turn answers."""
    tok = chat.load_tokenizer(tiny)
    assert chat.resolve_tool_format(tok, "code") == "code"
    assert ToolEnv.stop_strings("code") == ["</code>"] and ToolEnv.stop_strings("text") == []

    def reply(ctx):
        if "<output>42" not in ctx:
            return "Let me compute.\n<code>\nprint(6 * 7)\n</code> and then I keep talking"
        return "The answer is 42."

    engine = StoppingEngine(tok, reply)
    eps = Episodes(partial(ToolEnv, ("python",)), tok, _score, max_turns=3, max_tokens=200, timeout=10,
                   tool_format="code")  # fmt: skip
    ro = eps.run(M.load_causal_lm(tiny, tok), _rows(2), seeds=[1, 2], engine=engine)
    _check_token_in_token_out(ro, engine.contexts)
    assert ro.scores.tolist() == [1.0, 1.0] and ro.stats["env/tool_calls"].tolist() == [1, 1]
    assert ro.stats["env/tool_errors"].tolist() == [0, 0] and not ro.truncated.any()
    assert "You can run Python" in ro.transcripts[0] and "<output>42</output>" in ro.transcripts[0]
    assert "keep talking" not in ro.transcripts[0]
    end = chat.stop_ids(tok)[0]  # <|im_end|>
    (ctx, first), _ = ro.turn_ids[0]
    assert tok.decode(first[:-1]).endswith("</code>") and first[-1] == end
    row, mask = ro.responses[0].tolist(), ro.response_mask[0].tolist()
    at = len(first) - 1  # the appended turn end: the model's token, the sampler's log-prob 0
    assert row[at] == end and mask[at] == 1 and ro.logprobs[0, at].item() == 0.0 and ro.logprobs[0, at - 1].item() == -1
    # the trained row renders as the chat template renders the conversation (multi-turn SFT's rule)
    assert tok.decode(row[: at + 1]).endswith("</code><|im_end|>")


def test_the_code_protocol_parses_blocks_and_names_an_unclosed_one():
    calls = parse_tool_calls("a\n<code>\nx = 6\nprint(x * 7)\n</code>\nb <code>print(1)</code>", "code")
    assert calls == [{"name": "python", "arguments": {"code": "x = 6\nprint(x * 7)"}},
                     {"name": "python", "arguments": {"code": "print(1)"}}]  # fmt: skip
    assert parse_tool_calls("the answer is 3", "code") == []
    assert parse_tool_calls("<code>print(1)", "code") == ["error: <code> without </code>"]
    text = chat.format_tool_call("python", {"code": "print(2)"}, "code")
    assert parse_tool_calls(text, "code") == [{"name": "python", "arguments": {"code": "print(2)"}}]
    with pytest.raises(ValueError, match="Python tool only"):
        chat.format_tool_call("calculator", {"expression": "1+1"}, "code")
