"""The transport of a weight sync: a broadcast group of {trainer rank 0} ∪ {servers}.

Only this module knows what the group is. Here it is gloo on CPU, made beside (or
without) the torchrun default group from a TCPStore that rank 0 hosts:
`TCPStore(host, port, world, is_master=True)` + `ProcessGroupGloo(store, 0, world)`.
The CPU engine joins it the same way as rank `rank_offset`.

Not done yet: NCCL. Against vLLM the group must be vLLM's `StatelessProcessGroup` +
`PyNcclCommunicator` on the trainer's GPU (what vLLM's `NCCLWeightTransferEngine.
trainer_init` builds); a `NcclBroadcastGroup` with the same `broadcast(tensor, src)`
method is the only piece to add.
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch
import torch.distributed as dist


class BroadcastGroup(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def close(self) -> None: ...


class GlooBroadcastGroup:
    """Rank 0 of a gloo group; blocks in the constructor until every rank has joined."""

    def __init__(self, listen_host: str, listen_port: int, world_size: int, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.world_size = world_size
        self.store = dist.TCPStore(listen_host, listen_port, world_size, is_master=True,
                                   timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, 0, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None
