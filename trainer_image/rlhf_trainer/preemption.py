"""SIGTERM without losing work (preemption, a node drain, a spot notice, suspend, Ctrl-C in
local mode): the handler only notes the time; the run loop asks at safe points, all ranks
together, whether any rank was told to stop, and then ends the run with a complete
checkpoint inside `runPolicy.terminationGracePeriodSeconds`.

Safe points (loop.py, rl/loop.py):
- before each step: save the step reached, exit with `ExitCode.TERMINATED`;
- an RL step between its rollouts and its update: when the update and the save would not
  fit in the time left (from the last step's and the last save's durations), the step is
  abandoned: nothing of it has touched the models, the checkpoint is of the step before
  (with the data position from before its rollouts); otherwise it is finished without its
  weight sync (the servers are going away; a resumed run syncs them first).

Not done: a rollout phase in flight is not interrupted (rank 0 waits for its servers, which
on a cluster get the same SIGTERM); a save that does not fit the grace period is cut by
SIGKILL and leaves a partial checkpoint, never used (it has no marker).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("rlhf_trainer")


class Preempted(Exception):
    """The run stopped on SIGTERM after saving the checkpoint of `step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped by SIGTERM; checkpoint of step {step} written, the job resumes from it")
        self.step = step


class StepAbandoned(Exception):
    """The step in flight is dropped on SIGTERM (its update would not fit the grace period)."""


@dataclass(frozen=True)
class Decision:
    stop: bool
    """Some rank got SIGTERM."""
    remaining_s: float
    """The least time left to SIGKILL over the ranks told to stop."""
    needed_s: float
    """The most time any rank expects to need to finish the step and save."""

    @property
    def abandon(self) -> bool:
        return self.stop and self.needed_s > self.remaining_s


class StopRequest:
    """The time a SIGTERM arrived in this process (none yet: None)."""

    def __init__(self) -> None:
        self.grace_s = 30.0
        self.received_at: float | None = None

    def install(self, grace_s: float) -> None:
        """Catch SIGTERM from now on (call before the models load)."""
        self.grace_s = float(grace_s)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
            log.warning("SIGTERM: ending the step in flight and saving a checkpoint within %.0f s", self.grace_s)

    def remaining_s(self) -> float:
        if self.received_at is None:
            return float("inf")
        return self.grace_s - (time.monotonic() - self.received_at)

    def agree(self, needed_s: float, device: torch.device) -> Decision:
        """Collective: whether any rank was told to stop, the least time left, the most needed."""
        remaining = min(self.remaining_s(), 1e12)
        values = torch.tensor([float(self.received_at is not None), -remaining, float(needed_s)],
                              dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        flag, neg_remaining, needed = values.tolist()
        return Decision(stop=flag > 0, remaining_s=-neg_remaining, needed_s=needed)


STOP = StopRequest()
"""This process's: `STOP.install(grace)` in main, `STOP.agree(...)` at the loop's safe points."""
