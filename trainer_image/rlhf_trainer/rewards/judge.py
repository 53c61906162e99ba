"""`reward.type: judge`: an LLM judge behind an OpenAI-compatible endpoint scores each response.

For each response the rubric (`judge.template`) is filled with the prompt (text, or chat
turns as `role: content` lines), the response and the reference answer, and sent as one user
turn to `POST <url>/chat/completions` (`judge.api: chat`) or as the prompt to `POST
<url>/completions` (`completions`), at `judge.temperature`, up to `judge.maxTokens`. The
endpoint is `judge.url` (with the key of RLHF_JUDGE_API_KEY as a bearer token), or the job's
own judge servers (`<job>-judge`, RLHF_JUDGE_ENDPOINTS, requests spread over them in turn).

The answer is parsed (`parse_score`): with `judge.choices`, the last choice word it names
(whole word, case-insensitive) gives its reward; otherwise a number in [minScore, maxScore],
scaled to 0..1: the one after a "score" label (`Score: 7`, `<score>7</score>`) if any, else a
number standing alone, else the last number of the answer. An answer that gives none is
*unparsable*: it does not apply (None: 0 in the trained reward, left out of
`reward/<name>_mean`), is counted (`reward/<name>_parse_failures`) and logged with its text;
never a silent 0. Every request's tokens (prompt + completion, from the answer's `usage`)
are counted in `reward/<name>_judge_tokens`.

At most `judge.maxConcurrency` requests are in flight; each has `reward.timeoutSeconds`;
connection errors, timeouts, 429 and 5xx are retried `judge.maxRetries` times with backoff,
then the step fails naming the endpoint (RewardError: a judge that cannot be reached is an
outage, not a score). Any other HTTP status fails at once.

Simplifications: one request per response (no batching of several responses into one
rubric); the judge's reasoning is not kept; `temperature` 0 does not make a served judge
deterministic across batch shapes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
import threading
from typing import TYPE_CHECKING, Any, Sequence

import httpx

from rlhf_contract.pod import ENV_JUDGE_API_KEY, JUDGE_SERVED_MODEL

from ..retry import Retry, TryAgain
from .custom import RewardError, RewardResult

if TYPE_CHECKING:
    from rlhf_contract.api.task import JudgeSpec

log = logging.getLogger(__name__)

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_LABELLED = re.compile(r"score(?:\s+is)?[^\w+-]{0,3}(" + _NUMBER + r")", re.IGNORECASE)
_ALONE = re.compile(r"^[^\w+-]*(" + _NUMBER + r")[^\w+-]*$")
_ANY = re.compile(_NUMBER)


def prompt_text(prompt: str | list[dict]) -> str:
    """The prompt as the rubric shows it: the text, or chat turns as `role: content` lines."""
    if isinstance(prompt, list):
        return "\n".join(f"{t.get('role', 'user')}: {t.get('content', '')}" for t in prompt)
    return prompt


def render(spec: "JudgeSpec", sample: Any) -> str:
    """The rubric of one sample."""
    return spec.template.format(prompt=prompt_text(sample.prompt), response=sample.response, answer=sample.answer,
                                min_score=_fmt(spec.min_score), max_score=_fmt(spec.max_score))


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_score(text: str, spec: "JudgeSpec") -> float | None:
    """The reward an answer gives (module docstring), or None when it gives none."""
    if spec.choices:
        words = {w.lower(): v for w, v in spec.choices.items()}
        pattern = r"\b(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + r")\b"
        found = re.findall(pattern, text, re.IGNORECASE)
        return float(words[found[-1].lower()]) if found else None
    for pattern in (_LABELLED, _ALONE):
        m = pattern.findall(text.strip())
        if m:
            value = float(m[-1])
            break
    else:
        numbers = _ANY.findall(text)
        if not numbers:
            return None
        value = float(numbers[-1])
    if not math.isfinite(value) or not spec.min_score <= value <= spec.max_score:
        return None
    return (value - spec.min_score) / (spec.max_score - spec.min_score)


class Judge:
    """The batch scorer of a judge (module docstring); `drain_counters()` gives the step's
    parse failures and judge tokens."""

    def __init__(self, spec: "JudgeSpec", *, timeout_s: float, url: str | None = None, backoff_s: float = 0.5):
        urls = [spec.url] if spec.url else [u for u in (url or "").split(",") if u]
        if not urls:
            raise ValueError("reward.judge.url is not set and the job has no judge servers (RLHF_JUDGE_ENDPOINTS); "
                             "set judge.url, or run the job where its judge servers start (rlhfctl run, the operator)")
        self.spec, self.timeout_s = spec, timeout_s
        self.urls = [u.rstrip("/") + ("" if spec.url else "/v1") for u in urls]
        self.model = spec.model if spec.url else JUDGE_SERVED_MODEL
        self.api_key = os.environ.get(ENV_JUDGE_API_KEY) if spec.url else None
        self.retry_policy = Retry(attempts=spec.max_retries + 1, delay_s=backoff_s, max_delay_s=10.0)
        """Connection errors, timeouts, 429 and 5xx: `judge.maxRetries` more attempts, `backoff_s`,
        then twice as long each time, at most 10 s."""
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._counts = {"parse_failures": 0, "judge_tokens": 0}

    def _request(self, rubric: str) -> tuple[str, dict[str, Any]]:
        s = self.spec
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.api == "chat":
            return "/chat/completions", {**body, "messages": [{"role": "user", "content": rubric}]}
        return "/completions", {**body, "prompt": rubric}

    async def _ask(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, rubric: str) -> tuple[str, int]:
        """(the judge's answer, its tokens)."""
        path, body = self._request(rubric)
        url = self.urls[next(self._turn) % len(self.urls)] + path

        async def attempt() -> httpx.Response:
            try:
                async with sem:
                    r = await client.post(url, json=body)
            except httpx.TransportError as err:
                raise TryAgain(f"{type(err).__name__}: {err}") from err
            if r.status_code == 429 or r.status_code >= 500:
                raise TryAgain(f"HTTP {r.status_code}")
            if r.status_code >= 400:
                raise RewardError(f"judge {url} answered HTTP {r.status_code}: {r.text[:300]!r}")
            return r

        try:
            r = await self.retry_policy.acall(attempt)
        except TryAgain as last:
            raise RewardError(f"judge {url} failed {self.spec.max_retries + 1} times (reward.timeoutSeconds "
                              f"{self.timeout_s:g} each); last: {last}") from None
        try:
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.spec.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RewardError(f"judge {url} answered {r.text[:300]!r}, not an OpenAI {self.spec.api} completion "
                              "(choices[0]); is judge.api right?") from None
        usage = data.get("usage") or {}
        return text or "", int(usage.get("total_tokens") or
                               (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0))

    async def ascore_batch(self, samples: Sequence[Any]) -> list[RewardResult | None]:
        sem = asyncio.Semaphore(self.spec.max_concurrency)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.spec.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=headers) as client:
            answers = await asyncio.gather(*(self._ask(client, sem, render(self.spec, s)) for s in samples))
        out: list[RewardResult | None] = []
        failures = []
        for text, _ in answers:
            value = parse_score(text, self.spec)
            out.append((value, value) if value is not None else None)
            if value is None:
                failures.append(text)
        with self._lock:
            self._counts["parse_failures"] += len(failures)
            self._counts["judge_tokens"] += sum(n for _, n in answers)
        if failures:
            log.warning("judge %s: %d of %d answers unparsable (left out of the reward), the first: %r",
                        self.model, len(failures), len(answers), failures[0][:200])
        return out

    def score_batch(self, samples: Sequence[Any]) -> list[RewardResult | None]:
        """`ascore_batch` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.ascore_batch(samples))

    def drain_counters(self) -> dict[str, float]:
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return dict(counts)


def wait_for_judges(urls: list[str], *, timeout_s: float, period_s: float = 2.0) -> None:
    """Until each of the job's own judge servers answers /health (they load their model while
    the trainer starts); RewardError naming the first that does not within `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(url.rstrip("/") + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RewardError(f"judge server {url} did not answer /health in {timeout_s:g} s "
                                  "(rollout.startupTimeoutSeconds); see its log")
            time.sleep(period_s)
