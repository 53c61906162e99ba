"""Replacing a rollout server that died, without a job restart (`rollout.maxServerReplacements`).

Rank 0 only; the run loop asks it at each step boundary (`WeightSync.push` and
`WeightSync.servers_changed`, rl/placement.py):

- a server the rollout client found gone (a refused connection, a dropped request:
  client.py `leave_out`) is routed nothing more, and its requests went to the others, so
  the step goes on;
- at the step boundary every configured server's /health is asked: the weight-sync group
  is formed again (weight_sync/sender.py `reform`) with those that answer, then the
  current weights are pushed to all of them; a server that was gone and answers again
  (restarted: by the launcher in local mode, by its StatefulSet's kubelet on a cluster)
  is in that group, and only once the push is over is it routed requests again;
- a round that fails (a server died during it) is `recover`ed: the group is formed again
  with the servers that answer and the round is sent again.

Each server dropped from the group (not answering /health at a boundary or after a failed
round) counts as one replacement, and a failed round in which no server was lost counts one.
A member the client left out that answers is re-joined (formed again, pushed to) without
counting: it restarted between two boundaries, or a connection merely dropped. Past the budget, or with no server left, the failure is a `WeightSyncError`: the
trainer exits 75 and the job restarts, as without replacement. `count` is the step row's
`rollout_server_replacements`.
A group left `stuck` (a thread still inside NCCL on it: weight_sync/nccl.py) is never
formed again: `recover` answers False and the trainer exits 75.
"""

from __future__ import annotations

import logging

import httpx

from ..weight_sync import WeightSyncError
from ..weight_sync.threads import GroupStuck

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0


class ServerReplacement:
    """Rank 0's replacement of lost rollout servers (see the module docstring)."""

    def __init__(self, sender, client, budget: int):
        self.sender, self.client, self.budget = sender, client, budget
        self.count = 0
        self._admit: list[str] = []  # in the group again: routed to once the next push is over

    def _alive(self) -> list[str]:
        alive = []
        for endpoint in self.sender.configured:
            try:
                if httpx.get(endpoint + "/health", timeout=HEALTH_TIMEOUT_S).status_code == 200:
                    alive.append(endpoint)
            except httpx.HTTPError:
                pass
        return alive

    def _spend(self, lost: int, why: str) -> None:
        self.count += lost
        if self.count > self.budget:
            raise WeightSyncError(f"{why}: {self.count} rollout server replacements in this attempt, past "
                                  f"rollout.maxServerReplacements={self.budget}: the job restarts")
        log.warning("%s: replacement %d of %d (rollout.maxServerReplacements)", why, self.count, self.budget)

    def _reform(self, alive: list[str], *, failed_round: bool) -> None:
        if not alive:
            raise WeightSyncError("every rollout server is gone: the job restarts")
        members = self.sender.endpoints
        lost = [e for e in members if e not in alive]
        lost_count = len(lost) or (1 if failed_round else 0)
        if lost_count:
            self._spend(lost_count, f"rollout servers lost: {', '.join(lost) or 'none, a failed round'}")
        for endpoint in lost:
            self.client.leave_out(endpoint)
        self._admit = [e for e in alive if e in self.client.left_out]
        log.warning("weight-sync group formed again with %s", ", ".join(alive))
        try:
            self.sender.reform(alive)
        except WeightSyncError:
            raise
        except Exception as exc:  # a server gone again while asked (RolloutError), ...
            raise WeightSyncError(f"forming the weight-sync group again with {', '.join(alive)} failed: {exc}") from exc

    def changed(self) -> bool:
        """Whether the group must be formed again: a member gone, or a server back."""
        alive = self._alive()
        return alive != self.sender.endpoints or any(e in self.client.left_out for e in alive)

    def before_push(self) -> None:
        """At a step boundary: form the group with the servers that answer, if it changed."""
        alive = self._alive()
        if alive != self.sender.endpoints or any(e in self.client.left_out for e in alive):
            self._reform(alive, failed_round=False)

    def after_push(self) -> None:
        """The push is over: the servers that re-joined hold the current weights."""
        for endpoint in self._admit:
            log.info("rollout server %s holds the current weights: routed to again", endpoint)
            self.client.readmit(endpoint)
        self._admit = []

    def recover(self, error: WeightSyncError) -> bool:
        """A round failed: form the group again with the servers that answer (True), or
        False when the budget is spent or none is left (the error then ends the attempt)."""
        log.warning("weight sync failed: %s", error)
        if isinstance(error, GroupStuck) or getattr(self.sender, "stuck", False):
            log.error("a thread is still inside NCCL on the failed group: no group forms again in this process")
            return False
        try:
            self._reform(self._alive(), failed_round=True)
        except WeightSyncError as exc:
            log.error("%s", exc)
            return False
        return True
