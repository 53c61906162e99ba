"""Bounded off-policy rollouts (`rollout.maxStaleness` = k >= 1): rank 0 generates the
batches of the next steps on a background thread while the trainer trains.

The producer generates step j's batch only once the trainer has taken step j - k's, and
tags it with the policy version the servers held when it started (`served_version`,
advanced only after a weight sync completed). The trainer takes step j's batch when the
servers hold version j - 1, so a batch lags at most k versions: the tag is a lower bound
(a weight sync during generation lets in-flight requests finish on the old weights,
"wait" pause; requests after it see the new ones), so the staleness logged is never
under-stated. With `rollout.inFlightUpdates` the sync pauses with mode "keep" instead: the
requests in flight go on with the new weights, and `take` bounds and measures staleness
per token (staleness.py); with the plain sampler, in-flight updates use partial rollouts
instead (partial.py: a step takes the first groups to complete).

Exactly once: a batch is the rows of one `collect(step)`, whatever weight updates happened
while its requests ran (a request paused by an update is resumed, never dropped or sent
again), and `take` hands each step's batch out once, so every sample is trained once.

Resume: the checkpoint holds the data position after the last batch the trainer TOOK;
batches generated ahead are dropped with the process and regenerated after a resume
(same prompts and sampling seeds, the checkpoint's weights).

End: the producer stops after `last_step` (nothing is generated past the run), and
`close()` stops it and waits for a collect in flight to end (the caller closes the
rollout client afterwards; on an error it closes the client first, which ends the
requests in flight), so the run ends within seconds of its last step.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .staleness import bound_stale_tokens
from .types import RolloutBatch


class Prefetcher:
    whole_batches = True
    """Each batch is one `collect`, started at one version (the gate keeps it within k)."""

    def __init__(self, orchestrator: Any, *, max_staleness: int, first_step: int, last_step: int,
                 served_version: Callable[[], int]):
        self.orchestrator, self.k, self.served_version = orchestrator, max_staleness, served_version
        self.last_step = last_step
        self._cond = threading.Condition()
        self._ready: dict[int, RolloutBatch | BaseException] = {}
        self._taken = first_step - 1  # the last step whose batch the trainer took
        self._stop = False
        self._thread = threading.Thread(target=self._produce, args=(first_step,), name="rollout-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, step: int) -> None:
        data = self.orchestrator.data
        while step <= self.last_step:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or step - self._taken <= self.k)
                if self._stop:
                    return
            version = self.served_version()
            try:
                batch = self.orchestrator.collect(step)
            except BaseException as err:  # surfaces in the trainer's take()
                with self._cond:
                    self._ready[step] = err
                    self._cond.notify_all()
                return
            batch.policy_version, batch.data_position = version, data.state_dict()
            with self._cond:
                self._ready[step] = batch
                self._cond.notify_all()
            step += 1

    def take(self, step: int) -> RolloutBatch:
        """Step `step`'s batch (blocks until generated); lets the producer go on."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._ready)
            item = self._ready.pop(step)
            self._taken = step
            self._cond.notify_all()
        if isinstance(item, BaseException):
            raise item
        # per token: a response may span weight updates (rollout.inFlightUpdates)
        item.token_staleness = bound_stale_tokens(item, trained_version=self.served_version(),
                                                           max_staleness=self.k)
        return item

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop producing; wait up to `timeout_s` for a collect in flight to return."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
