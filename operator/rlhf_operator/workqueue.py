"""A de-duplicating work queue of job keys, as client-go's workqueue: a key waits in the
queue at most once however many events name it; a key is never processed by two workers
at once; a key added while it is being processed is processed again afterwards. So the
pod events of one busy job cost one reconcile per round, not one each, and cannot hold
every worker while other jobs wait. Events folded into one queued item are reported as
the most telling of their triggers (`priority`), e.g. a pod event over a resync. An
urgent key (a pod failed: the restart decision waits on it) goes to the front."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Hashable

log = logging.getLogger(__name__)


class WorkQueue:
    def __init__(self, process: Callable[[Hashable, str], None], workers: int = 4, name: str = "reconcile",
                 priority: Callable[[str], int] = lambda trigger: 0,
                 on_depth: Callable[[int], None] = lambda depth: None,
                 on_wait: Callable[[float], None] = lambda seconds: None):
        self._process = process
        self._priority = priority
        self._on_depth, self._on_wait = on_depth, on_wait  # observers (the operator's metrics)
        self._added: dict[Hashable, float] = {}  # key -> when it was queued
        self._cond = threading.Condition()
        self._order: deque[Hashable] = deque()
        self._queued: dict[Hashable, str] = {}  # key -> its trigger of highest priority
        self._active: set[Hashable] = set()
        self._again: dict[Hashable, str] = {}  # added while active
        self._urgent_again: set[Hashable] = set()
        self._stopped = False
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"{name}-{i}")
                         for i in range(workers)]

    def start(self) -> "WorkQueue":
        for t in self._threads:
            t.start()
        return self

    def _merge(self, pending: dict[Hashable, str], key: Hashable, trigger: str) -> bool:
        """Fold `trigger` into `pending[key]`; True when the key was not pending."""
        old = pending.get(key)
        if old is None or self._priority(trigger) > self._priority(old):
            pending[key] = trigger
        return old is None

    def add(self, key: Hashable, trigger: str, urgent: bool = False) -> None:
        with self._cond:
            if key in self._active:
                self._merge(self._again, key, trigger)
                if urgent:
                    self._urgent_again.add(key)
            elif self._merge(self._queued, key, trigger):
                self._order.appendleft(key) if urgent else self._order.append(key)
                self._added[key] = time.monotonic()
                self._on_depth(len(self._queued))
                self._cond.notify()
            elif urgent:
                self._order.remove(key)
                self._order.appendleft(key)

    def __len__(self) -> int:
        with self._cond:
            return len(self._queued)

    def idle(self) -> bool:
        with self._cond:
            return not self._queued and not self._active and not self._again

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._order and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                key = self._order.popleft()
                trigger = self._queued.pop(key)
                self._active.add(key)
                self._on_wait(time.monotonic() - self._added.pop(key, time.monotonic()))
                self._on_depth(len(self._queued))
            try:
                self._process(key, trigger)
            except Exception:  # noqa: BLE001 - logged; the next event or resync retries
                log.exception("processing %s failed", key)
            finally:
                with self._cond:
                    self._active.discard(key)
                    again = self._again.pop(key, None)
                    urgent = key in self._urgent_again
                    self._urgent_again.discard(key)
                    if again is not None and key not in self._queued:
                        self._queued[key] = again
                        self._order.appendleft(key) if urgent else self._order.append(key)
                        self._added[key] = time.monotonic()
                        self._on_depth(len(self._queued))
                        self._cond.notify()
