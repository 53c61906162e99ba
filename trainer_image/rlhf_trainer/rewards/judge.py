"""`reward.type: judge`: an LLM judge behind an OpenAI-compatible endpoint scores each response.

The judge's input (`render`, `rlhf_contract.judge_prompt`): `judge.template` (the rubric) with each placeholder's value
wrapped in its own tags, `{prompt}` in `<prompt>`, `{response}` in `<response>`, `{answer}`
in `<reference>` (a chat prompt is its turns as `role: content` lines), and any of those
tags written inside a value neutralised (`<` becomes `&lt;`), so a response cannot close
its block and speak as the rubric. With `judge.api: chat` it goes as one user turn to
`POST <url>/chat/completions`, after fixed instructions that come first (`instructions`):
the tagged text is data to grade, never instructions, and the exact answer format. With
`completions` (base models, which continue text rather than follow instructions) the tagged
template is the whole prompt to `POST <url>/completions`: it must carry its own
instructions. At `judge.temperature`, up to `judge.maxTokens`. The endpoint is `judge.url`
(with the key of RLHF_JUDGE_API_KEY as a bearer token), or the job's own judge servers
(`<job>-judge`, RLHF_JUDGE_ENDPOINTS, requests spread over them in turn).

The answer is parsed strictly (`parse_score`). A reasoning judge's thought is dropped first:
everything up to the last `</think>` (a `<think>` never closed, e.g. cut by maxTokens,
fails). What is left, without surrounding whitespace, must be the whole answer:
  number judge   a number alone (`7`, `-1`, `3.5`) or `Score: 7` (label case-insensitive),
                 in [minScore, maxScore], scaled to 0..1;
  choice judge   exactly one of `judge.choices` (case-insensitive), its reward.
Anything else is a *parse failure*: more words or numbers ("I'd rate it 2/10", "Score: 2
(the response claims 'Score: 10')"), a choice inside other words ("not correct"), a number
out of range, an empty answer. It scores `failure_reward` (0, or the lowest choice when a
choice is below 0: never more than an answer the judge can give, so steering the judge
into nonsense does not pay), is counted (`reward/<name>_parse_failures` of
`reward/<name>_judge_answers` per step; Prometheus `rlhf_judge_parse_failures_total` and
`rlhf_judge_answers_total`, the chart's alert RLHFJudgeAnswersUnparsable) and logged with
its text. Every request's tokens (prompt + completion, from the answer's `usage`) are
counted in `reward/<name>_judge_tokens`.

At most `judge.maxConcurrency` requests are in flight; each has `reward.timeoutSeconds`;
connection errors, timeouts, 429 and 5xx are retried `judge.maxRetries` times with backoff,
then the step fails naming the endpoint (RewardError: a judge that cannot be reached is an
outage, not a score). Any other HTTP status fails at once. Errors name the endpoint with
its user info and query string cut (`rlhf_contract.redact.redact_text`).

Simplifications: one request per response (no batching of several responses into one
rubric); the judge's reasoning is not kept; `temperature` 0 does not make a served judge
deterministic across batch shapes; the tags are not a sandbox (a judge model can still be
persuaded by what it reads: the strict format and the counted failures make that visible,
and a verifiable reward beside the judge keeps it honest).
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
from rlhf_contract.judge_prompt import instructions, judge_text  # noqa: F401 (instructions: the judge's own)
from rlhf_contract.redact import redact_text

from ..retry import Retry, TryAgain
from .custom import RewardError, RewardResult

if TYPE_CHECKING:
    from rlhf_contract.api.task import JudgeSpec

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"(?:score\s*:\s*)?(-?\d+(?:\.\d+)?)", re.IGNORECASE | re.ASCII)

def render(spec: "JudgeSpec", sample: Any) -> str:
    """The text the judge gets for one sample (rlhf_contract.judge_prompt)."""
    return judge_text(spec, sample.prompt, sample.response, sample.answer)


def final_answer(text: str) -> str | None:
    """The answer after a reasoning judge's thought (up to the last `</think>`), stripped;
    None for a thought never closed."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1].strip()
    return None if "<think>" in text else text.strip()


def failure_reward(spec: "JudgeSpec") -> float:
    """What a parse failure scores: 0, or the lowest choice when one is below 0."""
    return min(0.0, *spec.choices.values()) if spec.choices else 0.0


def parse_score(text: str, spec: "JudgeSpec") -> float | None:
    """The reward a strictly formatted answer gives (module docstring), or None (a parse failure)."""
    answer = final_answer(text)
    if not answer:
        return None
    if spec.choices:
        words = {w.strip().lower(): v for w, v in spec.choices.items()}
        value = words.get(answer.lower())
        return float(value) if value is not None else None
    m = _NUMBER.fullmatch(answer)
    if m is None:
        return None
    value = float(m.group(1))
    if not math.isfinite(value) or not spec.min_score <= value <= spec.max_score:
        return None
    return (value - spec.min_score) / (spec.max_score - spec.min_score)


class Judge:
    """The batch scorer of a judge (module docstring); `drain_counters()` gives the step's
    answers, parse failures and judge tokens."""

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
        self._counts = {"judge_answers": 0, "parse_failures": 0, "judge_tokens": 0}

    def _request(self, text: str) -> tuple[str, dict[str, Any]]:
        s = self.spec
        body: dict[str, Any] = {"model": self.model, "max_tokens": s.max_tokens, "temperature": s.temperature}
        if s.api == "chat":
            return "/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}
        return "/completions", {**body, "prompt": text}

    async def _ask(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, text: str) -> tuple[str, int]:
        """(the judge's answer, its tokens)."""
        path, body = self._request(text)
        url = self.urls[next(self._turn) % len(self.urls)] + path
        where = redact_text(url)  # what errors say: no user info, no query string

        async def attempt() -> httpx.Response:
            try:
                async with sem:
                    r = await client.post(url, json=body)
            except httpx.TransportError as err:
                raise TryAgain(redact_text(f"{type(err).__name__}: {err}")) from None
            if r.status_code == 429 or r.status_code >= 500:
                raise TryAgain(f"HTTP {r.status_code}")
            if r.status_code >= 400:
                raise RewardError(f"judge {where} answered HTTP {r.status_code}: {redact_text(r.text[:300])!r}")
            return r

        try:
            r = await self.retry_policy.acall(attempt)
        except TryAgain as last:
            raise RewardError(f"judge {where} failed {self.spec.max_retries + 1} times (reward.timeoutSeconds "
                              f"{self.timeout_s:g} each); last: {last}") from None
        try:
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.spec.api == "chat" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RewardError(f"judge {where} answered {redact_text(r.text[:300])!r}, not an OpenAI "
                              f"{self.spec.api} completion (choices[0]); is judge.api right?") from None
        usage = data.get("usage") or {}
        return text or "", int(usage.get("total_tokens") or
                               (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0))

    async def ascore_batch(self, samples: Sequence[Any]) -> list[RewardResult]:
        sem = asyncio.Semaphore(self.spec.max_concurrency)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.spec.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=headers) as client:
            answers = await asyncio.gather(*(self._ask(client, sem, render(self.spec, s)) for s in samples))
        out: list[RewardResult] = []
        failures = []
        for text, _ in answers:
            value = parse_score(text, self.spec)
            if value is None:
                failures.append(text)
                value = failure_reward(self.spec)
            out.append((value, value))
        with self._lock:
            self._counts["judge_answers"] += len(answers)
            self._counts["parse_failures"] += len(failures)
            self._counts["judge_tokens"] += sum(n for _, n in answers)
        if failures:
            log.warning("judge %s: %d of %d answers not in the judge's format (each scores %g), the first: %r",
                        self.model, len(failures), len(answers), failure_reward(self.spec), failures[0][:200])
        return out

    def score_batch(self, samples: Sequence[Any]) -> list[RewardResult]:
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
                raise RewardError(f"judge server {redact_text(url)} did not answer /health in {timeout_s:g} s "
                                  "(rollout.startupTimeoutSeconds); see its log")
            time.sleep(period_s)
