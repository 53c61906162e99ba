"""The operator's de-duplicating work queue (rlhf_operator.workqueue), with real threads."""

from __future__ import annotations

import threading
import time

from rlhf_operator.workqueue import WorkQueue


class Recorder:
    """Processes keys; key "slow" blocks until released."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.running: set[str] = set()
        self.overlap = False
        self.release = threading.Event()
        self.started = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, key, trigger):
        with self.lock:
            self.overlap |= key in self.running
            self.running.add(key)
            self.calls.append((key, trigger))
        if key == "slow":
            self.started.set()
            self.release.wait(5)
        else:
            time.sleep(0.01)
        with self.lock:
            self.running.discard(key)


def wait_idle(q: WorkQueue, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not q.idle():
        assert time.monotonic() < deadline, "queue never drained"
        time.sleep(0.01)


def test_events_of_one_job_queued_together_cost_one_reconcile():
    rec = Recorder()
    q = WorkQueue(rec, workers=2, priority={"resync": 0, "job": 1, "pod": 2}.__getitem__)
    q.add("a", "job")
    for _ in range(50):
        q.add("a", "pod")
    q.add("a", "resync")
    q.add("b", "resync")
    assert len(q) == 2
    q.start()
    wait_idle(q)
    q.stop()
    assert sorted(rec.calls) == [("a", "pod"), ("b", "resync")]  # reported as the most specific trigger


def test_a_key_added_while_it_runs_runs_again_afterwards_never_twice_at_once():
    rec = Recorder()
    q = WorkQueue(rec, workers=4).start()
    q.add("slow", "job")
    assert rec.started.wait(5)
    for _ in range(10):
        q.add("slow", "pod")  # while it runs: one more round, not ten, and not in parallel
    for k in ("x", "y", "z"):
        q.add(k, "pod")  # other jobs are not held up by the busy one
    deadline = time.monotonic() + 5
    while len([c for c in rec.calls if c[0] in "xyz"]) < 3:
        assert time.monotonic() < deadline, "other keys waited for the busy one"
        time.sleep(0.01)
    assert [c for c in rec.calls if c[0] == "slow"] == [("slow", "job")]
    rec.release.set()
    wait_idle(q)
    q.stop()
    assert [c for c in rec.calls if c[0] == "slow"] == [("slow", "job"), ("slow", "pod")]
    assert not rec.overlap


def test_an_exception_does_not_kill_the_worker():
    seen = []

    def process(key, trigger):
        seen.append(key)
        if key == "bad":
            raise RuntimeError("boom")

    q = WorkQueue(process, workers=1).start()
    q.add("bad", "job")
    q.add("good", "job")
    wait_idle(q)
    q.stop()
    assert seen == ["bad", "good"]


def test_an_urgent_key_jumps_the_queue():
    order = []
    q = WorkQueue(lambda key, trigger: order.append(key), workers=1)
    for k in ("a", "b", "c"):
        q.add(k, "resync")
    q.add("failed", "pod", urgent=True)
    q.add("b", "pod", urgent=True)  # already queued: moves to the front
    q.start()
    wait_idle(q)
    q.stop()
    assert order == ["b", "failed", "a", "c"]
