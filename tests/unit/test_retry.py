"""The one retry helper (rlhf_trainer.retry): what it retries, its waits, its budget, its
deadline, the error it ends with; sync and async alike, on a fake clock (and once on the real
one)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from rlhf_trainer import retry
from rlhf_trainer.retry import Retry, TryAgain


class Clock:
    """Stands for `time` and `asyncio` in rlhf_trainer.retry: sleeping moves the clock on."""

    def __init__(self):
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(retry, "time", fake)
    monkeypatch.setattr(retry, "asyncio", SimpleNamespace(sleep=fake.asleep))
    return fake


def failing(errors: list[BaseException], result="done", clock: Clock | None = None,
            takes_s: float = 0.0):
    """An attempt that raises errors[i] on call i and then returns `result`; records the
    (fake) time of each call."""
    calls: list[float] = []

    def fn():
        calls.append(clock.now if clock else 0.0)
        if clock:
            clock.now += takes_s
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return result

    return fn, calls


def run(policy: Retry, fn, asynchronous: bool, **kwargs):
    if not asynchronous:
        return policy.call(fn, **kwargs)

    async def afn():
        return fn()

    return asyncio.run(policy.acall(afn, **kwargs))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_retries_what_it_should_with_capped_exponential_waits(clock, asynchronous):
    policy = Retry(attempts=6, delay_s=0.5, factor=2.0, max_delay_s=3.0)
    fn, calls = failing([TryAgain(str(i)) for i in range(5)], clock=clock)
    assert run(policy, fn, asynchronous) == "done"
    assert len(calls) == 6
    assert clock.sleeps == [0.5, 1.0, 2.0, 3.0, 3.0]  # doubled, then capped
    assert [policy.wait_s(i) for i in range(5)] == clock.sleeps


@pytest.mark.parametrize("asynchronous", [False, True])
def test_other_errors_go_up_at_once(clock, asynchronous):
    policy = Retry(attempts=5, delay_s=1.0, retry_on=(ConnectionError,))
    fn, calls = failing([ConnectionRefusedError("down"), KeyError("bug")], clock=clock)
    with pytest.raises(KeyError, match="bug"):
        run(policy, fn, asynchronous)
    assert len(calls) == 2 and clock.sleeps == [1.0]  # the subclass was retried, the bug was not
    fn, calls = failing([TryAgain("not in retry_on")], clock=clock)
    with pytest.raises(TryAgain):
        run(policy, fn, asynchronous)
    assert len(calls) == 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_stops_at_the_budget_and_raises_the_last_error(clock, asynchronous):
    errors = [TryAgain(f"failure {i}") for i in range(10)]
    fn, calls = failing(errors, clock=clock)
    with pytest.raises(TryAgain) as info:
        run(Retry(attempts=4, delay_s=0.25, factor=4.0), fn, asynchronous)
    assert info.value is errors[3] and len(calls) == 4
    assert clock.sleeps == [0.25, 1.0, 4.0]  # no wait after the last attempt
    fn, calls = failing(errors, clock=clock)
    with pytest.raises(TryAgain) as info:
        run(Retry(attempts=1, delay_s=1.0), fn, asynchronous)
    assert info.value is errors[0] and len(calls) == 1


@pytest.mark.parametrize("asynchronous", [False, True])
def test_honours_the_deadline(clock, asynchronous):
    # no attempt limit: attempts at t = 0, 1, 2, 3 (each takes 0.1 s); the next wait would
    # end at 4.1 > 3.5, so the fourth failure goes up
    errors = [TryAgain(f"failure {i}") for i in range(100)]
    fn, calls = failing(errors, clock=clock, takes_s=0.1)
    start = clock.now
    with pytest.raises(TryAgain) as info:
        run(Retry(attempts=None, delay_s=0.9, factor=1.0, deadline_s=3.5), fn, asynchronous)
    assert [round(t - start, 6) for t in calls] == [0.0, 1.0, 2.0, 3.0]
    assert info.value is errors[3]
    # an absolute deadline per call cuts a policy's own deadline and budget shorter...
    fn, calls = failing(errors, clock=clock)
    with pytest.raises(TryAgain):
        run(Retry(attempts=10, delay_s=1.0, factor=1.0, deadline_s=60), fn, asynchronous,
            deadline=clock.now + 2.5)
    assert len(calls) == 3
    # ...and never lengthens them
    fn, calls = failing(errors, clock=clock)
    with pytest.raises(TryAgain):
        run(Retry(attempts=10, delay_s=1.0, factor=1.0, deadline_s=1.5), fn, asynchronous,
            deadline=clock.now + 60)
    assert len(calls) == 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_servers_retry_after_lengthens_the_wait_within_the_deadline(clock, asynchronous):
    policy = Retry(attempts=5, delay_s=0.5, factor=2.0, deadline_s=20)
    fn, calls = failing([TryAgain("429", after_s=7.0), TryAgain("503"), TryAgain("429", after_s=0.1)], clock=clock)
    assert run(policy, fn, asynchronous) == "done"
    assert clock.sleeps == [7.0, 1.0, 2.0]  # at least what the server asked; never shorter than our own wait
    fn, calls = failing([TryAgain("429", after_s=30.0)], clock=clock)
    with pytest.raises(TryAgain):  # a Retry-After past the deadline: give up now rather than sleep past it
        run(policy, fn, asynchronous)
    assert len(calls) == 1
    assert retry.retry_after("12") == 12.0 and retry.retry_after("Wed, 21 Oct 2026 07:28:00 GMT") is None
    assert retry.retry_after(None) is None and retry.retry_after("-3") == 0.0


def test_real_clock_sync_and_async():
    policy = Retry(attempts=None, delay_s=0.05, factor=1.0, deadline_s=0.3)
    for asynchronous in (False, True):
        fn, calls = failing([TryAgain("x")] * 1000)
        start = time.monotonic()
        with pytest.raises(TryAgain):
            run(policy, fn, asynchronous)
        assert 0.2 <= time.monotonic() - start < 0.5 and 4 <= len(calls) <= 7


def test_a_policy_must_be_able_to_end():
    with pytest.raises(ValueError, match="at least 1 attempt"):
        Retry(attempts=0, delay_s=1.0)
    with pytest.raises(ValueError, match="needs a deadline"):
        Retry(attempts=None, delay_s=1.0)
    with pytest.raises(ValueError, match="bad backoff"):
        Retry(attempts=2, delay_s=1.0, factor=0.5)
