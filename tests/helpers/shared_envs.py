"""What the tests of test_envs.py share (tests/*/test_envs.py: the tiers, and other test modules)."""

import sys
from pathlib import Path

import torch

from common.core.data import PromptRow
from common.core.envs import Environment, Step
from common.core.generation import Generation, response_masks

REPO = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO / "algos"))


# ------------------------------------------------------------------ a scripted sampler: the rollout loop, exactly
class ScriptedEngine:
    """Stands in for an engine (common.core.generation.generate's `engine=`): replies with `reply(context_text,
    row_index)` + EOS, token ids of the policy's tokenizer, log-probs -1 each. Records every context it was given."""

    def __init__(self, tok, reply):
        self.tok, self.reply, self.contexts = tok, reply, []

    def sync(self, model):
        pass

    def generate(self, queries, attention_mask, max_new_tokens, temperature, top_k, top_p, seeds, stop_strings=None):
        outs = []
        for q, m in zip(queries, attention_mask):
            ctx = q[m.bool()].tolist()
            self.contexts.append(ctx)
            text = self.reply(self.tok.decode(ctx))
            outs.append(
                (self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])[:max_new_tokens]
            )
        T = max(len(o) for o in outs)
        responses = torch.full((len(outs), T), self.tok.pad_token_id)
        for i, o in enumerate(outs):
            responses[i, : len(o)] = torch.tensor(o)
        mask, is_eos, lengths = response_masks(responses, self.tok.eos_token_id, self.tok.pad_token_id)
        return Generation(torch.cat([queries, responses], 1), responses, mask, is_eos, (lengths == max_new_tokens) & ~is_eos,
                       -mask)  # fmt: skip


class StoppingEngine(ScriptedEngine):
    """ScriptedEngine that honours stop strings as the engines do: a reply that holds one is cut after it (the stop
    string kept, no EOS); any other reply ends with EOS."""

    def generate(self, queries, attention_mask, max_new_tokens, temperature, top_k, top_p, seeds, stop_strings=None):
        outs, stops = [], []
        for q, m in zip(queries, attention_mask):
            ctx = q[m.bool()].tolist()
            self.contexts.append(ctx)
            text = self.reply(self.tok.decode(ctx))
            hit = min((text.index(s) + len(s) for s in stop_strings or () if s in text), default=None)
            ids = self.tok(text[:hit] if hit else text, add_special_tokens=False)["input_ids"]
            outs.append((ids if hit else ids + [self.tok.eos_token_id])[:max_new_tokens])
            stops.append(hit is not None)
        T = max(len(o) for o in outs)
        responses = torch.full((len(outs), T), self.tok.pad_token_id)
        for i, o in enumerate(outs):
            responses[i, : len(o)] = torch.tensor(o)
        stopped = torch.tensor(stops)
        mask, is_eos, lengths = response_masks(responses, self.tok.eos_token_id, self.tok.pad_token_id, stopped)
        truncated = (lengths == max_new_tokens) & ~is_eos & ~stopped
        return Generation(torch.cat([queries, responses], 1), responses, mask, is_eos, truncated, -mask)


def _rows(n=2):
    return [
        PromptRow(text="", data_source="toy", ground_truth="42", messages=[{"role": "user", "content": f"q{i}: 6*7?"}])
        for i in range(n)
    ]


def _score(row, text):
    return 1.0 if row.ground_truth in text else 0.0


THINK_DROPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and '</think>' in m['content'] %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Returns(Environment):
    """An environment whose reset or step returns `what` (one of the wrong things users' environments return)."""

    def __init__(self, where, what):
        self.where, self.what = where, what

    def reset(self, row):
        return self.what if self.where == "reset" else super().reset(row)

    def step(self, text, ids):
        if self.where == "step":
            return self.what
        obs = self.what if self.where == "observation" else [{"role": "user", "content": "go on"}]
        info = self.what if self.where == "info" else {}
        return Step(obs, self.what if self.where == "reward" else 1.0, self.where == "done", info)


# ------------------------------------------------------------------ the scripts, end to end (a model that ends its
# turns)
TOY_REWARD = f"{REPO}/tests/helpers/toy_reward.py:compute_score"


def _env_flags(model, prompts, out, *extra, lr=3e-3):
    return [
        "--model-name-or-path", model, "--train-files", prompts, "--reward-fn", TOY_REWARD, "--output-dir", out,
        "--max-turns", 3, "--max-new-tokens", 40, "--max-trajectory-tokens", 160, "--learning-rate", lr,
        "--eval-every", 0, "--micro-batch-size", 4, *extra,
    ]  # fmt: skip


def _resumes_exactly(script, flags, tmp_path, env):
    """3 steps straight == its step-1 checkpoint resumed for steps 2-3 (in a copy of the run folder)."""
    import shutil

    from conftest import only_run, read_metrics, run_script

    run_script(script, *flags(tmp_path / "a"), "--total-steps", 3, "--save-every", 1, env=env)
    straight = only_run(tmp_path / "a")
    copy = tmp_path / "b" / straight.name
    shutil.copytree(straight, copy)
    run_script(script, *flags(tmp_path / "b"), "--total-steps", 3, "--resume", copy / "checkpoints" / "step_1", env=env)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]
    a, b = strip(read_metrics(straight)), strip(read_metrics(copy))
    assert a == b and [r["step"] for r in a] == [1, 2, 3]
    return a, straight
