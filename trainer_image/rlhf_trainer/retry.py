"""Retries with capped exponential backoff, sync and async: the ONE retry loop of the trainer.

A `Retry` policy says how many attempts in all, how long to wait between them (`delay_s`, then
`factor` times more each time, never more than `max_delay_s`), which errors are worth another
attempt (`retry_on`) and an overall deadline (`deadline_s` after the first attempt, or an
absolute `deadline=` per call). `policy.call(fn)` / `await policy.acall(fn)` call `fn()` until it
returns. An error not in `retry_on` goes up at once; when the attempts run out, or the next wait
would end past the deadline, the LAST error goes up as it was raised (callers wrap it in a
message that names their service). An attempt that is still running at the deadline is not
interrupted: the deadline decides only whether another one starts.

Conditions that are not exceptions (an HTTP status worth retrying) are raised by the attempt as
`TryAgain("why")`, the default `retry_on`; `TryAgain("why", after_s=N)` carries a server's
`Retry-After`: the next wait is at least that long (still within the deadline).

Each call site states its policy in one place, with a docstring: a constant, or an attribute
its constructor builds from its arguments (`rollout.client.RolloutClient.retry_policy` and
`.paused_policy`, `rewards.custom.RemoteReward.retry_policy`,
`sandbox.client.SandboxClient.retry_policy`, `sandbox.run.START_RETRY`).

Why not tenacity: the sandbox package, its service included, needs the standard library alone
(the tests run the service on the system Python, as an unprivileged uid), and this is all we
need of it (no jitter, no retry on a result, no statistics).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class TryAgain(Exception):
    """Raised by an attempt for a condition worth another attempt; `str()` says what it was,
    `after_s` the wait the server asked for (its Retry-After), if any."""

    def __init__(self, why: str = "", *, after_s: float | None = None):
        super().__init__(why)
        self.after_s = after_s


def retry_after(value: str | None) -> float | None:
    """Seconds from an HTTP `Retry-After` header (delta-seconds; an HTTP date is not read: None)."""
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Retry:
    """A retry policy (see the module docstring)."""
    attempts: int | None
    """Attempts in all, the first included (1: no retry); None: no limit but the deadline."""
    delay_s: float
    """The wait after the first failed attempt."""
    factor: float = 2.0
    """Each later wait is this many times the one before."""
    max_delay_s: float = math.inf
    """No single wait is longer."""
    retry_on: tuple[type[BaseException], ...] = (TryAgain,)
    """The errors worth another attempt; any other error goes up at once."""
    deadline_s: float | None = None
    """No wait that would end more than this long after the first attempt started."""

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"a retry policy needs at least 1 attempt, got {self.attempts}")
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("a retry policy without an attempt limit needs a deadline")
        if self.delay_s < 0 or self.factor < 1 or self.max_delay_s < 0:
            raise ValueError(f"bad backoff: delay_s {self.delay_s}, factor {self.factor}, "
                             f"max_delay_s {self.max_delay_s}")

    def wait_s(self, retry: int) -> float:
        """The wait before retry number `retry` (0: the second attempt)."""
        return min(self.delay_s * self.factor ** retry, self.max_delay_s)

    def _waits(self, deadline: float | None) -> Callable[[BaseException], float | None]:
        """The wait after each failed attempt (None: give up), until the attempts or the
        deadline run out; an error's `after_s` (a server's Retry-After) lengthens its wait (a
        deadline of the policy counts from this call: make it before the first attempt)."""
        if self.deadline_s is not None:
            own = time.monotonic() + self.deadline_s
            deadline = own if deadline is None else min(deadline, own)
        retries = itertools.count() if self.attempts is None else range(self.attempts - 1)
        waits = map(self.wait_s, retries)

        def after(err: BaseException) -> float | None:
            wait = next(waits, None)
            if wait is None:
                return None
            wait = max(wait, getattr(err, "after_s", None) or 0.0)
            return None if deadline is not None and time.monotonic() + wait > deadline else wait
        return after

    def call(self, fn: Callable[[], T], *, deadline: float | None = None) -> T:
        """`fn()` under this policy; `deadline` (time.monotonic()) cuts it shorter."""
        waits = self._waits(deadline)
        while True:
            try:
                return fn()
            except self.retry_on as err:
                wait = waits(err)
                if wait is None:
                    raise
            time.sleep(wait)

    async def acall(self, fn: Callable[[], Awaitable[T]], *, deadline: float | None = None) -> T:
        """`await fn()` under this policy (as `call`, waiting with asyncio.sleep)."""
        waits = self._waits(deadline)
        while True:
            try:
                return await fn()
            except self.retry_on as err:
                wait = waits(err)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
