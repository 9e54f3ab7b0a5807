"""Rewards as a run uses them: `Reward` combines sources by weight (`--reward "rule:1.0,model:0.5,length:0.1"`,
common.core.scorers for the rule sources) and `ScoreAsTheyFinish` scores rows while the batch's other rows decode.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from common.core.errors import UserError
from common.core.reward_workers import NOT_SCORED, RewardError, RewardPool, score_row
from common.core.scorers import check_data_sources, compute_score, format_score, load_reward_fn

# ---------------------------------------------------------------------------------------------
# Combining sources
# ---------------------------------------------------------------------------------------------
SOURCES = ("rule", "exact", "model", "format", "length", "length_bonus", "remote", "judge")


def parse_mix(spec: str) -> dict[str, float]:
    """ "rule:1.0,model:0.5" -> {"rule": 1.0, "model": 0.5}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition(":")
        if name not in SOURCES:
            raise UserError(f"--reward {spec!r}: unknown source {name!r}; use {', '.join(SOURCES)}")
        try:
            out[name] = float(w or 1.0)
        except ValueError:
            raise UserError(f"--reward {spec!r}: weight of {name!r} is not a number") from None
    if not out:
        raise UserError("--reward is empty")
    return out


class Reward:
    """Scores a batch of responses with a weighted mix of sources; logs each component.

    `fallback`: None raises RewardError naming the data_source, row and response when a reward
    function raises or returns NaN/inf; a number replaces that sample's score and counts a warning."""

    def __init__(
        self,
        mix: str = "rule:1.0",
        reward_fn: str | list[str] | None = None,
        reward_model=None,
        reward_tok=None,
        max_new_tokens: int = 1,
        fallback: float | None = None,
        batch_size: int = 16,
        reward_weights: list[float] | None = None,
        timeout: float = 60.0,
        workers: int = 2,
        worker_max_gb: float = 0.0,
        remote=None,
        judge=None,
    ):
        self.mix = parse_mix(mix)
        specs = [reward_fn] if isinstance(reward_fn, str) else list(reward_fn or [])
        if reward_weights is not None and len(reward_weights) != len(specs):
            raise UserError(
                f"--reward-weights: {len(reward_weights)} weight(s) for {len(specs)} --reward-fn function(s)"
            )
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(specs)
        fns = [load_reward_fn(spec) for spec in specs]
        names = [fn.__name__ for fn in fns]
        names = [
            n if names.count(n) == 1 else f"{Path(spec.rpartition(':')[0]).stem}.{n}" for n, spec in zip(names, specs)
        ]
        # (name, function, weight); the dispatcher alone when no --reward-fn is given
        self.rule_fns = list(zip(names, fns, weights)) or [("rule", compute_score, 1.0)]
        self.custom = bool(specs)
        self.timeout = timeout
        # custom functions run in a process pool (--reward-workers; 0: in the trainer); ours in-process
        self.pool = RewardPool(specs, workers, timeout, worker_max_gb) if specs and workers > 0 else None
        if "model" in self.mix and reward_model is None:
            raise UserError("--reward includes 'model' but no --reward-model was given")
        self.reward_model, self.reward_tok = reward_model, reward_tok
        # services (common.integrations.remote_rewards): each term needs its service and each service its term
        for term, service, flag in (("remote", remote, "--reward-url"), ("judge", judge, "--judge-url")):
            if (term in self.mix) != (service is not None):
                raise UserError(
                    f"--reward includes '{term}' but no {flag} was given"
                    if service is None
                    else f"{flag} was given but --reward has no '{term}' term (e.g. --reward rule:1.0,{term}:0.5)"
                )
        self.remote, self.judge = remote, judge
        self.max_new_tokens, self.fallback, self.batch_size = max_new_tokens, fallback, batch_size
        self.errors = 0

    def counts(self) -> dict:
        """This process's failure counts since the start, the nonzero ones: reward/errors (rows scored by the fallback
        or failed), reward/judge_unparsed (judge replies without a readable grade, each try; retried)."""
        judge = self.judge.unparsed if self.judge is not None else 0
        return {k: v for k, v in (("reward/errors", self.errors), ("reward/judge_unparsed", judge)) if v}

    def check(self, data_sources) -> None:
        if ("rule" in self.mix or "exact" in self.mix) and not self.custom:
            check_data_sources(data_sources)

    def _rule(self, row, response: str, outs: list[tuple[bool, object]]) -> tuple[float, dict]:
        """The rule score of one response from each function's raw output (score_row): the function's
        score (or the weighted sum of several), and extra fields to log (each function's own score
        under its name when there are several)."""
        where = f"data_source {row.data_source!r}, row {row.uid}, response {response[:200]!r}"
        total, extras = 0.0, {}
        for (name, _, weight), (ok, out) in zip(self.rule_fns, outs):
            try:
                if not ok:
                    raise RuntimeError(out)
                extra = dict(out) if isinstance(out, dict) else {}
                score = float(extra.pop("score") if isinstance(out, dict) else out)
                if not math.isfinite(score):
                    raise ValueError(f"reward function returned {score}")
            except Exception as e:
                if self.fallback is None:
                    raise RewardError(
                        f"reward function {name!r} failed on {where}: {e if not ok else repr(e)}"
                    ) from None
                self.errors += 1
                score, extra = self.fallback, {}
            total += weight * score
            extras.update(
                {k: v for k, v in extra.items() if isinstance(v, (int, float, bool))}
            )  # verl allows text fields too
            if len(self.rule_fns) > 1:
                extras[name] = score
        return total, extras

    @torch.no_grad()
    def _model(self, rows, responses: list[str], is_eos, device) -> torch.Tensor:
        """Normalised reward-model scores (B,), each sequence encoded exactly as rm_llm.py trained on it:
        the prompt rendered with the reward model's *own* tokenizer and chat template, the response
        text, and EOS when the response ended with one (the head was trained to read the score there)."""
        from common.core.chat import apply_chat
        from common.core.data import encode_prompt_response
        from common.core.generation import position_ids_from_mask

        tok, cfg, out = self.reward_tok, self.reward_model.config, []
        prompts = [
            apply_chat(tok, r.messages) if r.messages is not None else r.text for r in rows
        ]  # text: already templated
        eos = [bool(e) for e in is_eos] if is_eos is not None else [False] * len(rows)
        for i in range(0, len(rows), self.batch_size):
            sl = slice(i, i + self.batch_size)
            ids, attn, _ = encode_prompt_response(
                tok,
                prompts[sl],
                responses[sl],
                eos[sl],
                max_length=getattr(cfg, "reward_max_length", None),
                device=device,
            )
            # right padding, and position ids given anyway: absolute-position models (GPT-2) need them
            out.append(
                self.reward_model(input_ids=ids, attention_mask=attn, position_ids=position_ids_from_mask(attn))
                .logits[:, 0]
                .float()
            )
        # rm_llm.py stores the normalisation (mean 0, std 1 on a reference sample) in the config
        return torch.cat(out) * getattr(cfg, "reward_gain", 1.0) + getattr(cfg, "reward_bias", 0.0)

    @property
    def outside(self) -> bool:
        """Some of its calls run outside the trainer's thread (the --reward-fn worker pool, services): what
        ScoreAsTheyFinish overlaps with decoding."""
        return (self.pool is not None and ("rule" in self.mix or "exact" in self.mix)) or bool(
            self.remote or self.judge
        )

    def outside_parts(self, rows, responses: list[str], is_eos) -> dict:
        """The calls that run outside this thread, per row: {"raw": the pool's outputs, "remote"/"judge": (scores,
        failed)}. Safe in another thread (the in-process scorers are not: their timeouts are main-thread signals)."""
        parts = {}
        if self.pool is not None and ("rule" in self.mix or "exact" in self.mix):
            jobs = [(r.data_source, s, r.ground_truth, r.extra_info) for r, s in zip(rows, responses)]
            parts["raw"] = self.pool.map(jobs, stop_at_failure=self.fallback is None)
        for term, service in (("remote", self.remote), ("judge", self.judge)):
            if term in self.mix:  # a service: its failures after retries are the error, or --reward-fallback
                args = (rows, responses, is_eos) if term == "remote" else (rows, responses)
                parts[term] = service(*args, fallback=self.fallback)
        return parts

    def __call__(self, rows, responses: list[str], response_lens: torch.Tensor, device="cpu", is_eos=None, parts=None):
        """rows: PromptRow per response; responses: decoded texts (no special tokens); response_lens:
        (B,) token counts; is_eos: (B,) bool, the response ended with EOS (for the reward model); parts: what
        `outside_parts` returned for these rows, if already called (ScoreAsTheyFinish).
        Returns (scores (B,), components {name: (B,)}, extras {field: (B,)} e.g. acc)."""
        B = len(responses)
        comps, extras = {}, {}
        parts = parts if parts is not None else self.outside_parts(rows, responses, is_eos)
        if "rule" in self.mix or "exact" in self.mix:
            jobs = [(r.data_source, s, r.ground_truth, r.extra_info) for r, s in zip(rows, responses)]
            fns = [fn for _, fn, _ in self.rule_fns]
            raw = parts["raw"] if self.pool else [score_row(fns, self.timeout, *job) for job in jobs]
            # the row that failed is the error, not a row skipped after it (groups scored as rows finish: any order)
            failed = [i for i, outs in enumerate(raw) if any(not ok and out != NOT_SCORED for ok, out in outs)]
            if failed and self.fallback is None:
                self._rule(rows[failed[0]], responses[failed[0]], raw[failed[0]])
            vals = [self._rule(r, s, o) for r, s, o in zip(rows, responses, raw)]
            rule = torch.tensor([v[0] for v in vals], device=device)
            for k in {k for _, e in vals for k in e}:
                extras[k] = torch.tensor([float(e.get(k, 0.0)) for _, e in vals], device=device)
            if "rule" in self.mix:
                comps["rule"] = rule
            if "exact" in self.mix:  # the scorer's own exact-match field, else a full score
                comps["exact"] = extras["acc"].clone() if "acc" in extras else (rule >= 1).float()
        if "model" in self.mix:
            comps["model"] = self._model(rows, responses, is_eos, device).to(device)
        for term in ("remote", "judge"):
            if term in self.mix:
                vals, failed = parts[term]
                self.errors += failed
                comps[term] = torch.tensor(vals, device=device, dtype=torch.float)
        if "format" in self.mix:
            comps["format"] = torch.tensor([format_score(s) for s in responses], device=device)
        if "length" in self.mix:
            comps["length"] = -response_lens.float().to(device) / self.max_new_tokens
        if "length_bonus" in self.mix:
            comps["length_bonus"] = (response_lens.float().to(device) / self.max_new_tokens).clamp(max=1.0)
        scores = sum(self.mix[k] * v for k, v in comps.items())  # (B,)
        return scores.reshape(B), comps, extras


class ScoreAsTheyFinish:
    """Reward calls that run outside the trainer's thread (the --reward-fn worker pool, --reward-url,
    --judge-url) started on the responses decoding has finished while the rest of the batch still decodes:
    `generate(on_finished=this)` hands over each row as it ends (EOS or a stop string), a thread scores what has
    accumulated (one pool map or service request per group), and `parts` scores the rows cut at the token limit
    and waits. What runs in the trainer (built-in scorers, whose timeouts are main-thread signals; the reward
    model; format and length terms) runs after, on the whole batch. The scores are Reward's on the whole batch:
    each term is per row. vLLM returns a batch at once, so there is nothing to overlap
    (common.core.sampling.sample_and_score)."""

    def __init__(self, reward: Reward, rows, tok):
        import queue
        import threading

        self.reward, self.rows, self.tok = reward, rows, tok
        if reward.pool is not None:  # forked here, not from the thread while this one decodes (a fork copies
            reward.pool.start()  # locks other threads hold)
        self.todo, self.got, self.error, self.sent = queue.Queue(), [], None, set()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def __call__(self, idx: list[int], responses: torch.Tensor, stopped: torch.Tensor) -> None:
        """From the decoding loop: rows `idx` ended; responses (n, t) their tokens so far, stopped (n,) bool."""
        from common.core.chat import stop_ids  # here, not at the top: reward workers start without transformers
        from common.core.generation import response_masks

        _, is_eos, _ = response_masks(responses, stop_ids(self.tok), self.tok.pad_token_id, stopped)
        texts = self.tok.batch_decode(responses, skip_special_tokens=True)
        self.sent.update(idx)
        self.todo.put(list(zip(idx, texts, is_eos.tolist())))

    def _work(self):
        import queue

        while (item := self.todo.get()) is not None:
            while True:  # everything that ended meanwhile: one group
                try:
                    more = self.todo.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.todo.put(None)
                    break
                item += more
            if self.error is not None:
                continue
            idx, texts, eos = zip(*item)
            try:
                self.got.append((idx, self.reward.outside_parts([self.rows[i] for i in idx], list(texts), eos)))
            except BaseException as e:  # noqa: BLE001 -- raised in the trainer's thread by parts()
                self.error = e

    def parts(self, texts: list[str], is_eos) -> dict:
        """The rows not handed over yet (cut at the limit), then every row's parts in batch order."""
        rest = [(i, texts[i], bool(is_eos[i])) for i in range(len(self.rows)) if i not in self.sent]
        if rest:
            self.todo.put(rest)
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        B, out = len(self.rows), {}
        for idx, got in self.got:
            for key, value in got.items():
                if key == "raw":
                    slot = out.setdefault("raw", [None] * B)
                    for i, v in zip(idx, value):
                        slot[i] = v
                else:  # (scores, failed)
                    scores, failed = out.setdefault(key, ([None] * B, [0]))
                    for i, v in zip(idx, value[0]):
                        scores[i] = v
                    failed[0] += value[1]
        return {k: v if k == "raw" else (v[0], v[1][0]) for k, v in out.items()}
