"""The bounded off-policy producer (orchestrator/prefetch.py) with a stand-in orchestrator
that records the served policy version each batch started from: no batch the trainer
takes lags more than k versions, the producer runs ahead by at most k steps, and a
producer failure reaches the trainer."""

from __future__ import annotations

import threading
import time

import pytest

from rlhf_trainer.orchestrator.prefetch import Prefetcher
from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats


class Data:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}


class Orchestrator:
    def __init__(self, fail_at: int | None = None):
        self.data, self.fail_at, self.started = Data(), fail_at, []

    def collect(self, step: int) -> RolloutBatch:
        if step == self.fail_at:
            raise RuntimeError("rollout server gone")
        self.started.append(step)
        time.sleep(0.01)
        self.data.position += 4
        return RolloutBatch([], 1, RolloutStats(*[0] * 12), step=step)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_taken_batches_lag_at_most_k_versions(k):
    served = {"v": 0}
    orch = Orchestrator()
    pre = Prefetcher(orch, max_staleness=k, first_step=1, last_step=11, served_version=lambda: served["v"])
    lags = []
    for step in range(1, 12):
        batch = pre.take(step)
        assert batch.step == step and batch.data_position == {"position": 4 * step}
        lags.append(served["v"] - batch.policy_version)
        time.sleep(0.03)  # train, then the weight sync completes: the servers hold version `step`
        served["v"] = step
        assert max(orch.started) <= step + k  # never more than k steps ahead
    pre.close()
    assert 1 <= max(lags) <= k and min(lags) >= 0  # generation overlapped training, within the bound


def test_a_producer_failure_reaches_the_trainer():
    pre = Prefetcher(Orchestrator(fail_at=2), max_staleness=1, first_step=1, last_step=5, served_version=lambda: 0)
    pre.take(1)
    with pytest.raises(RuntimeError, match="rollout server gone"):
        pre.take(2)
    pre.close()


def test_resumed_producer_starts_at_the_resumed_step():
    orch = Orchestrator()
    pre = Prefetcher(orch, max_staleness=2, first_step=7, last_step=20, served_version=lambda: 6)
    assert pre.take(7).step == 7
    pre.close()
    assert min(orch.started) == 7 and threading.active_count() < 50


def test_nothing_is_generated_past_the_last_step_and_close_returns_at_once():
    """The exit hang: with maxStaleness >= 1 the producer used to generate the step after the
    last one, and the run waited for it. Now it stops at the last step, and closing a
    prefetcher whose collect is in flight waits for that collect, not more."""
    orch = Orchestrator()
    pre = Prefetcher(orch, max_staleness=2, first_step=1, last_step=3, served_version=lambda: 0)
    for step in (1, 2, 3):
        pre.take(step)
    start = time.monotonic()
    pre.close()
    assert time.monotonic() - start < 1.0
    assert orch.started == [1, 2, 3]  # never step 4 or 5, although k = 2 would allow them


def test_close_waits_for_a_collect_in_flight():
    class Slow(Orchestrator):
        def collect(self, step):
            time.sleep(0.5)
            return super().collect(step)

    orch = Slow()
    pre = Prefetcher(orch, max_staleness=1, first_step=1, last_step=10, served_version=lambda: 0)
    time.sleep(0.1)  # step 1 in flight
    pre.close()
    assert not pre._thread.is_alive() and orch.started == [1]
