"""User-defined rewards: a Python function from a file, or a remote HTTP reward service.

Both give `(reward, score)` per response: `reward` feeds the advantages, `score` is only
logged (e.g. the task's accuracy while `reward` adds format or length shaping); `score`
defaults to `reward`.

A reward function (forms.py: ours per response, TRL's batched, veRL's compute_score; from a
file or an import path) returns a float or a dict `{"reward": float, "score": float?}` per
response. `extra_info` holds every column of the data row (see `rlhf_trainer.data.rendering`).

A reward service takes `POST <url>` with JSON `{"prompt", "response", "answer", "extra_info"}`
(`prompt`: the row's text, or its chat turns) and
answers `{"reward": float, "score": float?}`. Connection errors, timeouts, 429 and 5xx are
retried `max_retries` times with exponential backoff (`RemoteReward.retry_policy`); any other
status, a malformed answer or running out of retries raises `RewardError` naming the URL.

A python function may also return None or NaN for a response: "does not apply" (forms.py).

Simplifications: the user function runs in the trainer process, unsandboxed and trusted
(it is the user's code, not the model's); an `async def` function runs on the process's one
reward event loop (forms.reward_loop), so it may keep loop-bound state (a client) between
calls. Infinite rewards are rejected rather than clipped.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Iterable

import httpx

from rlhf_trainer.retry import Retry, TryAgain

RewardResult = tuple[float, float]
"""(reward used for advantages, score that is logged)."""

FLOAT32_MAX = 3.4028234663852886e38
"""Largest reward a function may return: the trainer computes in float32."""


class RewardError(RuntimeError):
    """A custom reward failed: the user function raised, or the service failed or misbehaved."""


def normalize_result(value: Any) -> RewardResult:
    """A float, or a dict with `reward` and optional `score` -> (reward, score).

    Raises ValueError for anything else, including NaN and infinities.
    """
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"a reward dict needs a 'reward' key, got keys {sorted(value)}")
        reward = _number(value["reward"], "reward")
        score = _number(value["score"], "score") if value.get("score") is not None else reward
        return reward, score
    reward = _number(value, "reward")
    return reward, reward


def _number(value: Any, what: str) -> float:
    if value is None or isinstance(value, (str, bytes)):
        raise ValueError(f"{what} must be a number, got {value!r:.100}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} "
                         f"{value!r:.100}") from None
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    if abs(number) > FLOAT32_MAX:  # the trainer's tensors are float32
        raise ValueError(f"{what} must be within +-{FLOAT32_MAX:.3g} (float32), got {number:.3g}")
    return number


class RemoteReward:
    """A reward service at `url` (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 30.0, max_retries: int = 3, *,
                 max_concurrency: int = 32, backoff_s: float = 0.5) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward URL {url!r} must start with http:// or https://")
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self.retry_policy = Retry(attempts=max_retries + 1, delay_s=backoff_s, max_delay_s=10.0)
        """Connection errors, timeouts, 429 and 5xx: `max_retries` more attempts, `backoff_s`,
        then twice as long each time, at most 10 s."""

    def _result(self, response: httpx.Response) -> RewardResult:
        try:
            return normalize_result(response.json())
        except (ValueError, TypeError) as err:  # JSON decode errors are ValueErrors
            raise RewardError(f"reward service {self.url} answered {response.text[:200]!r}: "
                              f"{err}; it must answer {{\"reward\": float, \"score\": float?}}"
                              ) from None

    def _retryable(self, response: httpx.Response) -> bool:
        if response.status_code == 429 or response.status_code >= 500:
            return True
        if response.status_code >= 400:
            raise RewardError(f"reward service {self.url} answered HTTP {response.status_code}: "
                              f"{response.text[:200]!r}")
        return False

    def __call__(self, response: str, answer: str, extra_info: dict) -> RewardResult:
        """One request, synchronously (the batch path with a batch of one)."""
        return self.score_batch([(response, answer, extra_info)])[0]

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore,
                   payload: dict) -> RewardResult:
        async def attempt() -> RewardResult:
            try:
                async with sem:
                    r = await client.post(self.url, json=payload)
            except httpx.TransportError as err:
                raise TryAgain(f"{type(err).__name__}: {err}") from err
            if self._retryable(r):
                raise TryAgain(f"HTTP {r.status_code}")
            return self._result(r)

        try:
            return await self.retry_policy.acall(attempt)
        except TryAgain as last:
            raise RewardError(f"reward service {self.url} failed {self.max_retries + 1} times; "
                              f"last: {last}") from None

    async def ascore_batch(self, items: Iterable[Any]) -> list[RewardResult]:
        """(reward, score) for each `Sample` (or (response, answer, extra_info)), up to
        `max_concurrency` requests in flight, results in input order."""
        from .sample import Sample

        samples = [x if isinstance(x, Sample) else Sample(*x) for x in items]
        payloads = [{"prompt": s.prompt, "response": s.response, "answer": s.answer, "extra_info": s.extra_info}
                    for s in samples]
        sem = asyncio.Semaphore(self.max_concurrency)
        limits = httpx.Limits(max_connections=self.max_concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            return list(await asyncio.gather(*(self._one(client, sem, p) for p in payloads)))

    def score_batch(self, items: Iterable[tuple[str, str, dict]]) -> list[RewardResult]:
        """`ascore_batch` from synchronous code (not from inside a running event loop)."""
        return asyncio.run(self.ascore_batch(items))
