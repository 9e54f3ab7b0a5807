"""Rewards from services: a reward model or any scorer behind HTTP (`--reward-url`, the `remote` term of --reward),
and an LLM judge behind an OpenAI-compatible endpoint (`--judge-url`, the `judge` term). docs/data.md has the
protocol; `python -m tools.serve_rm RM_FOLDER` serves an rm_llm.py model over it.

Both clients send requests concurrently (threads: the work is waiting on sockets), each with a timeout, and retry
a failed request (no answer, a 5xx, a malformed answer) with exponential backoff; a 4xx is the request's own
fault and is not retried. A service still failing after the retries is the batch's error (one line naming the
URL), or, with --reward-fallback, its rows get the fallback score and are counted, as failing reward functions are.
Written on the standard library (urllib): no client package to install, and nothing here is hot enough to need one.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from common.core.errors import UserError


class ServiceError(UserError):
    """A reward service failed after its retries (or refused the request)."""


@dataclass
class ServiceConfig:
    url: str
    timeout: float = 30.0
    retries: int = 3
    concurrency: int = 4
    batch_size: int = 32
    backoff: float = 0.5  # seconds before the first retry; doubled after each


MAX_ANSWER_BYTES = 16 << 20  # an answer larger than this is malformed (a scores list of 32 rows is a few hundred bytes)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is refused, never followed: urllib would re-send the request, its Authorization header (the
    judge's OPENAI_API_KEY) included, to whatever host the answer names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise ServiceError(f"{req.full_url}: answered with a redirect ({code}) to {newurl}; refusing to follow it "
                           "(a request's credentials never go to another address): give the final URL")  # fmt: skip


_OPENER = urllib.request.build_opener(_NoRedirects)


def _read_by(resp, deadline: float) -> bytes:
    """The whole body of `resp` by `deadline` (time.monotonic()): urlopen's timeout bounds each read, so a service
    that drips its answer a byte at a time would hold the batch for ever; and at most MAX_ANSWER_BYTES."""
    sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the answer did not arrive whole within the timeout")
        if sock is not None:
            sock.settimeout(left)
        try:
            chunk = resp.read1(1 << 16)
        except TimeoutError:  # the socket's timeout: the deadline reached mid-read
            raise TimeoutError("the answer did not arrive whole within the timeout") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ValueError(f"an answer over {MAX_ANSWER_BYTES >> 20} MB")
        chunks.append(chunk)


def post_json(url: str, body: dict, cfg: ServiceConfig, headers: dict | None = None, check=None):
    """POST `body` as JSON, return the JSON answer (or check(answer): it raises ValueError on a malformed one);
    retried as the module docstring says; each try bounded by cfg.timeout in all (connection and whole answer).
    Raises ServiceError."""
    data = json.dumps(body).encode()
    last = ""
    for attempt in range(cfg.retries + 1):
        if attempt:
            time.sleep(cfg.backoff * 2 ** (attempt - 1))
        req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
        deadline = time.monotonic() + cfg.timeout
        try:
            with _OPENER.open(req, timeout=cfg.timeout) as resp:
                out = json.loads(_read_by(resp, deadline))
            return check(out) if check is not None else out
        except ServiceError:  # a refused redirect: no retry sends it elsewhere
            raise
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code} {e.reason}"
            if 400 <= e.code < 500 and e.code not in (408, 429):  # the request's own fault: no retry helps
                detail = e.read()[:300].decode(errors="replace")
                raise ServiceError(f"{url}: refused the request ({last}: {detail})") from None
        except (OSError, ValueError, http.client.HTTPException) as e:  # no connection, a timeout, a cut, malformed
            last = f"{type(e).__name__}: {e}"
    raise ServiceError(f"{url}: no valid answer after {cfg.retries + 1} tries (last: {last[:300]})")


def _scores_of(out, n: int) -> list[float]:
    """{"scores": [n finite numbers]} -> the scores; anything else (strings, nulls, dicts, NaN, inf, another count)
    is a malformed answer: ValueError."""
    scores = out.get("scores") if isinstance(out, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        raise ValueError(f"answered {str(out)[:200]!r}, not {{'scores': [{n} numbers]}}")
    bad = [s for s in scores if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
    if bad:
        raise ValueError(f"scores must be finite numbers, got {bad[:3]!r}")
    return [float(s) for s in scores]


class RemoteScorer:
    """`--reward-url`: a batch of rows and responses POSTed in chunks of `batch_size`, `concurrency` at a time.

    Request: {"prompts": [the prompt before any template: a string or [{role, content}]], "responses": [str],
    "data_sources": [str], "ground_truths": [...], "extra_infos": [{}], "is_eos": [bool]}.
    Answer: {"scores": [float, one per response]}."""

    def __init__(self, cfg: ServiceConfig):
        self.cfg = cfg
        self.requests = 0

    def _chunk(self, rows, responses, is_eos) -> list[float]:
        body = {
            "prompts": [r.messages if r.messages is not None else r.text for r in rows],
            "responses": list(responses),
            "data_sources": [r.data_source for r in rows],
            "ground_truths": [r.ground_truth for r in rows],
            "extra_infos": [r.extra_info for r in rows],
            "is_eos": [bool(e) for e in is_eos],
        }
        self.requests += 1
        body = json.loads(json.dumps(body, default=str))
        return post_json(self.cfg.url, body, self.cfg, check=lambda out: _scores_of(out, len(rows)))

    def __call__(self, rows, responses, is_eos=None, fallback: float | None = None) -> tuple[list[float], int]:
        """Scores of every response, and how many took the fallback (a failed chunk: all its rows)."""
        is_eos = list(is_eos) if is_eos is not None else [False] * len(rows)
        n = self.cfg.batch_size
        chunks = [(rows[i : i + n], responses[i : i + n], is_eos[i : i + n]) for i in range(0, len(rows), n)]
        return _gather(lambda c: self._chunk(*c), chunks, [len(c[0]) for c in chunks], self.cfg, fallback)


def _gather(fn, items, sizes, cfg: ServiceConfig, fallback):
    """fn over items, `cfg.concurrency` at a time, in order; a failed item's `size` scores are the fallback."""
    with ThreadPoolExecutor(max_workers=max(1, cfg.concurrency)) as pool:
        futures = [pool.submit(fn, item) for item in items]
        out, failed = [], 0
        for fut, size in zip(futures, sizes):
            try:
                got = fut.result()
                out.extend(got if isinstance(got, list) else [got])
            except ServiceError:
                if fallback is None:
                    for other in futures:
                        other.cancel()
                    raise
                out.extend([fallback] * size)
                failed += size
    return out, failed


DEFAULT_JUDGE_TEMPLATE = """You grade an answer to a question.

Question:
{prompt}

Reference answer: {ground_truth}

Answer to grade:
{response}

Reply with one line, "Score: N", N an integer from 0 (wrong) to 10 (fully correct)."""


class JudgeScorer:
    """`--judge-url` / `--judge-model`: one chat completion per response from an OpenAI-compatible endpoint (`vllm
    serve`, a hosted API; the key from OPENAI_API_KEY when set), the prompt rendered from a template with
    {prompt}, {response}, {ground_truth} and {data_source}; the score is the reply's grade (parse_judge_score: on
    [0, scale]) divided by `scale` (10: into [0, 1]). A reply without a grade is a failed request (retried, then
    the error or the fallback). The endpoint's redirects are refused: the key never goes to another address."""

    def __init__(self, cfg: ServiceConfig, model: str, template: str = DEFAULT_JUDGE_TEMPLATE, scale: float = 10.0):
        import os

        base = cfg.url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.cfg, self.model, self.template, self.scale = cfg, model, template, scale
        key = os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.requests, self.unparsed = 0, 0  # unparsed: replies without a readable grade (reward/judge_unparsed)
        self._lock = threading.Lock()  # the requests run in a thread pool

    def render(self, row, response: str) -> str:
        prompt = row.messages if row.messages is not None else row.text
        if not isinstance(prompt, str):
            prompt = "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
        fields = dict(prompt=prompt, response=response, ground_truth=row.ground_truth, data_source=row.data_source)
        return self.template.format(**fields)

    def _one(self, item) -> float:
        row, response = item
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": self.render(row, response)}],
            "temperature": 0.0,
            "max_tokens": 32,
        }
        last = ""
        for attempt in range(self.cfg.retries + 1):  # an unreadable grade is retried like a failed request
            self.requests += 1
            out = post_json(self.url, body, self.cfg, self.headers)  # transport failures: retried inside
            try:
                text = out["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                text = None
            score = parse_judge_score(text, self.scale) if isinstance(text, str) else None
            if score is not None:
                return score / self.scale
            with self._lock:
                self.unparsed += 1
            last = repr(text if text is not None else out)[:200]
            if attempt < self.cfg.retries:
                time.sleep(self.cfg.backoff * 2**attempt)
        raise ServiceError(f"{self.url}: no score in the judge's answer after {self.cfg.retries + 1} tries ({last})")

    def __call__(self, rows, responses, fallback: float | None = None) -> tuple[list[float], int]:
        items = list(zip(rows, responses))
        return _gather(self._one, items, [1] * len(items), self.cfg, fallback)


_SCORE = re.compile(r"score\s*(?:\([^)]{0,20}\))?\s*\**\s*(?:[:=]|is)?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_LONE = re.compile(r"[*\s]*(-?\d+(?:\.\d+)?)\s*(?:/\s*\d+|out of \d+)?[.*\s]*")


def parse_judge_score(text: str, scale: float = 10.0) -> float | None:
    """The grade in a judge's reply, on [0, scale]: "Score: 7", "**Score:** 7/10", "Score (0-10): 7", "score = 7.5"
    (a grade outside [0, scale] is clamped to it: "Score: 85" is 10), or a reply that is a number alone ("7",
    "7/10"); None for anything else ("In 2024 ...", "I cannot tell"): an unparsable reply, retried and counted."""
    m = _SCORE.search(text)
    if m:
        return min(max(float(m.group(1)), 0.0), scale)
    m = _LONE.fullmatch(text.strip())
    return min(max(float(m.group(1)), 0.0), scale) if m else None
