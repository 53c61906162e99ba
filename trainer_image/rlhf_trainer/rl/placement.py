"""Where the rollout servers run (`rollout.placement`), as the one object the RL loop asks
(rl/loop.py), and the weight sync behind one object.

`placement_of(config, ...)` reads the spec's choice once (`colocated_spec`, also what the
colocated memory plan reads: preflight/memory_colocated.py) and returns:

- `Separate`: the servers have GPUs of their own. The hooks around a rollout and before a
  sync do nothing; a step syncs only when its weights changed (some optimizer step was
  taken); evaluation just generates.
- `Colocated`: the servers share the trainer's GPUs and the two take turns (rl/colocation.py
  has the turns and the servers' sleep calls). Before a rollout the servers wake (the
  trainer offloads with `offloadTrainer`), after it they sleep and the trainer reloads;
  before a sync the servers' weights wake; every step syncs (a level-2 sleep discards the
  servers' weights); evaluation generates in a turn of its own and syncs after it, so the
  state between steps stays the same.

`WeightSync` is the trainer's side of the weight sync: the sender on rank 0 (NCCL to
separate servers, CUDA IPC to colocated vLLM: weight_sync/), the policy version the servers
hold, and the placement's hook before each push; with `rollout.maxServerReplacements` > 0 and
separate servers, rank 0's replacement of lost servers (rl/replacement.py) around each push.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhf_contract.api.models import ColocatedSpec


def colocated_spec(config) -> ColocatedSpec | None:
    """`rollout.colocated` when the job's placement is colocated, else None: the one place
    the trainer reads the placement choice."""
    sampling = config.sampling
    return sampling.colocated if sampling.placement == "colocated" else None


class Separate:
    """Servers on GPUs of their own (see the module docstring)."""

    colocated = False

    def before_rollout(self) -> None:
        """Collective: before rank 0 collects a step's rollouts."""

    def after_rollout(self) -> None:
        """Collective: after the batch reached every rank, before the update."""

    def before_sync(self) -> None:
        """Collective: before the weights are pushed."""

    def should_sync(self, changed: bool) -> bool:
        """Whether a step whose weights `changed` (or not) pushes them."""
        return changed

    def evaluate(self, generate: Callable[[], dict[str, Any]], resync: Callable[[], float],
                 has_datasets: bool) -> dict[str, Any]:
        """Collective: the held-out scores (`generate`); `resync` pushes the weights again."""
        return generate()

    def close(self) -> None:
        pass


class Colocated(Separate):
    """Servers sharing the trainer's GPUs, in turns (see the module docstring)."""

    colocated = True

    def __init__(self, colocation):
        self.colocation = colocation  # rl/colocation.py Colocation

    def before_rollout(self) -> None:
        self.colocation.to_generation()

    def after_rollout(self) -> None:
        self.colocation.to_training()

    def before_sync(self) -> None:
        self.colocation.before_sync()

    def should_sync(self, changed: bool) -> bool:
        return True  # the servers slept through the update (level 2 discards their weights)

    def evaluate(self, generate, resync, has_datasets: bool) -> dict[str, Any]:
        if not has_datasets:
            return generate()
        self.colocation.to_generation()
        scores = generate()
        resync()  # back to the state between steps: servers asleep but for their weights
        return scores

    def close(self) -> None:
        self.colocation.close()


def placement_of(config, engines: list, endpoints: list[str], is_main: bool) -> Separate:
    """The job's placement object; `engines` are what colocation offloads in its turns."""
    spec = colocated_spec(config)
    if spec is None:
        return Separate()
    from .colocation import Colocation, ServerSleep

    servers = ServerSleep(endpoints, config.rollout_weight_sync_timeout_seconds) if is_main else None
    return Colocated(Colocation(spec, engines, servers))


class WeightSync:
    """The policy's weights to the rollout servers (see the module docstring). `sender` is
    rank 0's WeightSyncSender (None on the other ranks)."""

    def __init__(self, engine, sender, placement: Separate, *, replacements: int = 0, client=None):
        self.engine = engine
        self.sender = sender
        self.placement = placement
        self.replacing = replacements > 0 and not placement.colocated  # the same on every rank
        self.replacement = None  # rank 0's ServerReplacement
        if self.replacing and sender is not None:
            from .replacement import ServerReplacement

            client.replace_servers = True
            self.replacement = ServerReplacement(sender, client, replacements)
        self.ipc = None  # set in start(): the servers take weights by CUDA IPC
        self.served_version = 0  # what the servers hold (advanced after each completed push)

    def start(self, servers_info) -> None:
        """Collective: rank 0's handshake with the servers (`servers_info`: what the
        orchestrator's server check returned), then every rank learns the transport."""
        from ..weight_sync.push import ipc_sync

        if self.sender is not None:
            self.sender.init(servers_info)
        self.ipc = ipc_sync(self.sender)  # colocated vLLM: every rank exports its buffers

    def push(self, version: int) -> float:
        """Collective: the servers get the policy's weights tagged `version`; the seconds taken."""
        from ..weight_sync import push_weights

        self.placement.before_sync()
        recover = None
        if self.replacing and self.ipc is None:
            if self.replacement is not None:
                self.replacement.before_push()
            recover = self.replacement.recover if self.replacement is not None else _never
        seconds = push_weights(self.engine, self.sender, weight_version=str(version), ipc=self.ipc, recover=recover)
        if self.replacement is not None:
            self.replacement.after_push()
        self.served_version = version
        return seconds

    def servers_changed(self) -> bool:
        """Collective: whether a lost server must leave the group or a restarted one re-join
        (rank 0 asks, every rank learns); a push then follows even if the weights did not change."""
        if not self.replacing:
            return False
        from ..distributed import broadcast_object

        return bool(broadcast_object(self.replacement.changed() if self.replacement is not None else None))

    def row(self) -> dict:
        """Rank 0: the step row's `rollout_server_replacements` (with replacement on)."""
        return {"rollout_server_replacements": self.replacement.count} if self.replacement is not None else {}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def _never(error) -> bool:
    """The other ranks' `recover`: only rank 0 decides (push_weights broadcasts it)."""
    return False
