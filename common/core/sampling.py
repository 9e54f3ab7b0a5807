"""A step's rollout as one object: `sample(...) -> Rollout`, the same for one-turn and `--env` rollouts.

    with unwrap_for_generation(accelerator, policy) as gen_model:
        rollout = sample(gen_model, tok, rows, reward, episodes, device, seeds, engine, **args.gen.sampling())

One turn (`episodes` None): each row's templated prompt, one response, scored by `reward` (its calls outside this
process, the worker pool and services, run while the batch's other rows decode: common.core.rewards.ScoreAsTheyFinish).
`--env` (an `Episodes`): one trajectory per row, model turns and observations in `responses` with the
observations masked out (`mask` 0: no loss, GAE skips them), scored by the environment (docs/agents.md).
Everything after sampling (pi_old, advantages, the update, the logs) reads the same fields either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from common.core.envs import tool_metrics
from common.core.generation import PromptCache, generate, sequence_attention_mask, tokenize_queries
from common.core.rewards import Reward, ScoreAsTheyFinish


@dataclass
class Rollout:
    """B rows, row-aligned (B = the rows this process sampled; tensors on the trainer's device)."""

    rows: list  # (B,) the prompts' rows (common.core.data.PromptRow: .text, .data_source, .ground_truth, ...)
    texts: list[str]  # (B,) each response's text; --env: the whole conversation (samples.jsonl)
    queries: torch.Tensor  # (B, P) left-padded prompt ids; --env: the environment's first messages, rendered
    query_mask: torch.Tensor  # (B, P)
    responses: torch.Tensor  # (B, T) right-padded; --env: the model's turns and the observations between them
    mask: torch.Tensor  # (B, T) float: 1 on the model's tokens (with its EOS / stop string), 0 on padding, observations
    logprobs: torch.Tensor | None  # (B, T) the sampler's log-probs of its tokens (docs/rollout.md), 0 elsewhere
    is_eos: torch.Tensor  # (B,) bool: ended with EOS
    truncated: torch.Tensor  # (B,) bool: ran out of tokens (or turns) before an end
    scores: torch.Tensor  # (B,) the reward (--reward's mix, or the environment's)
    solved: torch.Tensor  # (B,) exact match: the scorer's `acc` when it reports one, else score >= 1
    logged: dict = field(default_factory=dict)  # name -> (B,): reward/<term>, env/<count>, ... (logged as batch means)
    prompt_cache: PromptCache | None = None  # generate(keep_prompt_cache=True): the prompts' KV cache (PPO's pi_old)
    turn_rewards: torch.Tensor | None = None  # (B, T) --env: each step's reward at its turn's last model token

    @property
    def query_responses(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.queries, self.responses], 1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P+T): the prompt's real tokens, then every response position
        return sequence_attention_mask(self.query_mask, self.responses.shape[1])

    @property
    def lengths(self) -> torch.Tensor:  # (B,) the model's tokens of each row
        return self.mask.sum(1)

    def take(self, idx: list[int]) -> Rollout:
        """Rows `idx`, in that order (no prompt cache). Lengths are unchanged: Rollout.cat re-pads."""
        pick = lambda v: [v[i] for i in idx] if isinstance(v, list) else None if v is None else v[idx]
        out = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name not in ("logged", "prompt_cache")}
        return replace(self, **out, logged={k: v[idx] for k, v in self.logged.items()}, prompt_cache=None)

    @staticmethod
    def cat(parts: list[Rollout], pad_id: int) -> Rollout:
        """One Rollout of several (dynamic sampling's rounds): prompts re-padded on the left to the longest, responses
        and the other (B, T) tensors on the right (ids with `pad_id`, the rest with 0). A logged term only some parts
        have is dropped."""
        P = max(p.queries.shape[1] for p in parts)
        T = max(p.responses.shape[1] for p in parts)
        left = lambda xs, fill: torch.cat([F.pad(x, (P - x.shape[1], 0), value=fill) for x in xs])
        right = lambda xs, fill=0: torch.cat([F.pad(x, (0, T - x.shape[1]), value=fill) for x in xs])
        get = lambda name: [getattr(p, name) for p in parts]
        keys = set.intersection(*(set(p.logged) for p in parts))
        return Rollout(
            rows=[r for p in parts for r in p.rows],
            texts=[t for p in parts for t in p.texts],
            queries=left(get("queries"), pad_id),
            query_mask=left(get("query_mask"), 0),
            responses=right(get("responses"), pad_id),
            mask=right(get("mask")),
            logprobs=None if any(p.logprobs is None for p in parts) else right(get("logprobs")),
            turn_rewards=None if any(p.turn_rewards is None for p in parts) else right(get("turn_rewards")),
            **{k: torch.cat(get(k)) for k in ("is_eos", "truncated", "scores", "solved")},
            logged={k: torch.cat([p.logged[k] for p in parts]) for k in parts[0].logged if k in keys},
        )

    def token_scores(self, scores) -> torch.Tensor:
        """PPO's per-token rewards before the KL term, (B, T): each row's score on its last model token; with --env
        each step's reward on the last model token of its own turn (GAE then credits a turn-1 reward to turn 1's
        tokens, not to turn 2's), and what `scores` (B,) holds beyond the steps' rewards (--missing-eos-penalty)
        on the last."""
        B, T = self.mask.shape
        out = torch.zeros_like(self.mask) if self.turn_rewards is None else self.turn_rewards.clone()
        last = T - 1 - self.mask.flip(1).argmax(1)  # (B,) the last model token of each row
        out[torch.arange(B, device=out.device), last] += scores - out.sum(1)
        return out

    def samples(self, scores, **columns) -> list[dict]:
        """samples.jsonl's rows for run.log: prompt, response, reward (`scores` (B,)), each of `columns` ((B,): the
        advantage, the KL, ...) and split "train"."""
        return [{"prompt": x.text, "response": t, "reward": float(s), **{k: float(v[i]) for k, v in columns.items()},
                 "split": "train"} for i, (x, t, s) in enumerate(zip(self.rows, self.texts, scores))]  # fmt: skip

    def metrics(self, accelerator) -> dict:
        """The keys every RL script logs about its samples, means over all processes' rows: train/response_len,
        train/truncated, the logged terms (reward/<term>, env/<count>) and, with --env tools, env/tool_* rates."""
        mean = lambda v: accelerator.gather(v).float().mean().item()
        out = {"train/response_len": mean(self.lengths), "train/truncated": mean(self.truncated)}
        out |= {k: accelerator.gather(v).mean().item() for k, v in self.logged.items()}
        return out | tool_metrics(out)


def sample_and_score(model, tok, queries, query_mask, rows, reward: Reward, device, **sampling):
    """generate() and reward() of one batch: (generation, texts, (scores (B,), components, extras)). Reward calls that
    run outside this thread overlap the decoding (ScoreAsTheyFinish) with our engine; vLLM's returns at once."""
    stream = ScoreAsTheyFinish(reward, rows, tok) if reward.outside and sampling.get("engine") is None else None
    gen = generate(model, tok, queries, query_mask, on_finished=stream, **sampling)
    texts = tok.batch_decode(gen.responses, skip_special_tokens=True)
    parts = stream.parts(texts, gen.is_eos.tolist()) if stream is not None else None
    return gen, texts, reward(rows, texts, gen.response_mask.sum(1), device, gen.is_eos, parts=parts)


def sample(model, tok, rows, reward: Reward, episodes, device, seeds, engine=None, keep_prompt_cache=False, **sampling):
    """Sample and score `rows` (one response or trajectory each; `seeds` (B,) per row, None: greedy) -> Rollout.
    `model`: the policy unwrapped for generation; `engine`: --rollout-engine's (None: our decoding loop);
    `episodes`: --env's Episodes, or None for one turn; `sampling`: max_new_tokens, temperature, top_k, top_p.
    keep_prompt_cache (one turn, our loop): the prompts' KV cache, for a pi_old forward over the responses only."""
    if episodes is None:
        queries, query_mask = tokenize_queries(tok, [x.text for x in rows], device)  # (B, P)
        gen, texts, (scores, components, extras) = sample_and_score(
            model, tok, queries, query_mask, rows, reward, device, seeds=seeds, engine=engine,
            keep_prompt_cache=keep_prompt_cache, **sampling,
        )  # fmt: skip
    else:  # the environment's reward of each trajectory, and its counts (env/turns, env/tool_calls, ...)
        gen = episodes.run(model, rows, seeds, engine, **sampling)
        queries, query_mask, texts = gen.queries, gen.query_mask, gen.transcripts
        scores, components, extras = gen.scores, gen.stats, {}
    return Rollout(
        rows=list(rows), texts=texts, queries=queries, query_mask=query_mask, responses=gen.responses,
        mask=gen.response_mask, logprobs=gen.logprobs, is_eos=gen.is_eos, truncated=gen.truncated, scores=scores,
        solved=extras.get("acc", (scores >= 1).float()),
        logged={k if "/" in k else f"reward/{k}": v for k, v in (components | extras).items()},
        prompt_cache=gen.prompt_cache, turn_rewards=getattr(gen, "turn_rewards", None),
    )  # fmt: skip
