"""What the RL scripts sample from, built from their flag groups: `rl_inputs` (the prompt tokenizer, the
reward, the prompts, the environments), `reward_from_args` / `services_from_args` (--reward's rules, models,
services and judges) and `episodes_from_args` (--env: a built-in, a user's class or a hub's environment). The
one place that picks which outside system a run talks to, beside `engines.make_engine`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from common.core import chat
from common.core.envs import Episodes
from common.core.errors import UserError
from common.core.rewards import Reward
from common.core.tasks import HUB_PREFIXES, is_hub_spec, load_rl_prompts  # noqa: F401  (the rows: common.core.tasks.env_rows)
from common.integrations.builtin_envs import FeedbackEnv, ToolEnv, load_env_class
from common.integrations.hub_envs import hub_factory


class RLInputs(NamedTuple):
    """What an RL script samples from (rl_inputs)."""

    max_len: int  # a sequence's longest: --max-prompt-length + --max-new-tokens (--env: + --max-trajectory-tokens)
    tok: object  # the prompt tokenizer
    reward: Reward  # --reward's rules, models and mixes
    train_rows: list  # the prompts: --train-files, else the built-in --task
    val_rows: list  # --val-files (or the task's held-out split)
    episodes: Episodes | None  # --env's episode runner, else None


def rl_inputs(model, data, rewards, gen, env, accelerator, say=None) -> RLInputs:
    """RLInputs from a script's flag groups (ModelArgs, PromptArgs, RewardArgs, GenerationArgs, EnvArgs). Every
    prompt's data_source is checked against the rewards. `say`: where their notes go (accelerator.print)."""
    say = say or accelerator.print
    max_len = data.max_prompt_length + env.budget(gen.max_new_tokens)
    tok = chat.prompt_tokenizer(model, data, max_len, "--max-prompt-length + --max-new-tokens")
    reward = reward_from_args(rewards, model, gen.max_new_tokens, accelerator)
    train_rows, val_rows = load_rl_prompts(data, tok, reward, say, env.env)
    episodes = episodes_from_args(env, tok, reward, accelerator.device, say, data.max_prompt_length)
    return RLInputs(max_len, tok, reward, train_rows, val_rows, episodes)


def reward_from_args(rewards, model, max_new_tokens: int, accelerator) -> Reward:
    """The Reward of a script's RewardArgs `rewards` (common.harness.args): --reward / --reward-fn, --reward-model
    (loaded frozen at --dtype of ModelArgs `model`, with its own tokenizer and chat template, which may differ from the
    policy's), --reward-weights, --reward-fallback, --reward-timeout and --reward-workers; responses are scored up to
    `max_new_tokens`."""
    from common.core import chat
    from common.core import models as M
    from common.parallel.sharded import prepare_frozen

    path, trust = rewards.reward_model, model.trust_remote_code
    if path:
        M.check_reward_model(path, "--reward-model", trust)  # a causal LM would score with a random head
    rm_tok = chat.load_reward_tokenizer(path, trust) if path else None  # with the prompt format it was trained on
    reward_model = prepare_frozen(accelerator, M.load_reward_model(path, rm_tok, model.dtype)) if path else None
    return Reward(
        rewards.reward,
        rewards.reward_fn,
        reward_model,
        rm_tok,
        max_new_tokens,
        rewards.reward_fallback,
        reward_weights=rewards.reward_weights,
        timeout=rewards.reward_timeout,
        workers=rewards.reward_workers,
        worker_max_gb=rewards.reward_worker_max_gb,
        **services_from_args(rewards),
    )


def services_from_args(rewards) -> dict:
    """The reward services of RewardArgs `rewards`: {remote: RemoteScorer | None, judge: JudgeScorer | None}."""
    from common.integrations.remote_rewards import DEFAULT_JUDGE_TEMPLATE, JudgeScorer, RemoteScorer, ServiceConfig

    cfg = lambda url: ServiceConfig(
        url, timeout=rewards.service_timeout, retries=rewards.service_retries, concurrency=rewards.service_concurrency
    )
    judge = None
    if rewards.judge_url:
        if not rewards.judge_model:
            raise UserError("--judge-url needs --judge-model (the model name the endpoint serves)")
        template = Path(rewards.judge_template).read_text() if rewards.judge_template else DEFAULT_JUDGE_TEMPLATE
        judge = JudgeScorer(cfg(rewards.judge_url), rewards.judge_model, template)
    return dict(remote=RemoteScorer(cfg(rewards.reward_url)) if rewards.reward_url else None, judge=judge)


# ---------------------------------------------------------------------------------------------
# --env -> Episodes (the built-ins, a user's class, a hub's environment)
# ---------------------------------------------------------------------------------------------
def episodes_from_args(env_args, tok, reward, device, log=print, max_prompt_tokens=None) -> Episodes | None:
    """The `Episodes` of a script's EnvArgs (common.harness.args; None without --env): the environment class, its
    options, and the run's reward (`reward`, common.core.rewards.Reward) as each trajectory's scorer; max_prompt_tokens:
    the longest first message an environment may return (--max-prompt-length)."""
    if not env_args.env:
        return None
    cls = None if is_hub_spec(env_args.env) else load_env_class(env_args.env)
    if cls is None:  # textarena:, openenv:
        factory = hub_factory(env_args.env, env_args, log)
    elif cls is ToolEnv:
        tools = tuple(t for t in env_args.tools.split(",") if t)
        if env_args.tool_format == "code" and "python" not in tools:
            raise UserError(f"--tool-format code: the programs run on the Python tool, and --tools {env_args.tools} "
                            "has no python")  # fmt: skip
        opts = dict(
            timeout=env_args.tool_timeout,
            memory_mb=env_args.tool_memory_mb,
            max_chars=env_args.tool_output_chars,
            sandbox=env_args.tool_sandbox,
            sandbox_url=env_args.tool_sandbox_url,
        )
        factory = partial(ToolEnv, tools, call_cost=env_args.turn_cost, **opts)
        factory()  # an unknown tool: one line now, not a counted failure per trajectory
    elif cls is FeedbackEnv:
        factory = partial(FeedbackEnv, turn_cost=env_args.turn_cost)
    else:
        factory = cls

    def score(row, text):
        scores, _, _ = reward([row], [text], torch.tensor([len(tok(text)["input_ids"])]), device, None)
        return float(scores[0])

    return Episodes(factory, tok, score, env_args.max_turns, env_args.max_trajectory_tokens, env_args.env_timeout, log,
                    max_prompt_tokens, workers=env_args.env_workers, tool_format=env_args.tool_format)  # fmt: skip
