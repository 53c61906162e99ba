"""torch.distributed set-up for the trainer: NCCL on GPU, gloo on CPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


COLLECTIVE_TIMEOUT_FLOOR_S = 1800


def collective_timeout_s(config) -> float:
    """How long the other ranks may wait in a collective for rank 0. They sit in one while
    rank 0 waits for the rollout servers to start, generates a step's rollouts and pushes
    weights, each bounded by its own spec field (`rollout.startupTimeoutSeconds`,
    `rollout.requestTimeoutSeconds` per try, `rollout.weightSyncTimeoutSeconds`): the
    process group allows all of them plus a margin, so a slow but healthy phase never kills
    the job, while a hung one is ended by rank 0's own bound (rank 0 then exits and torchrun
    stops the others)."""
    rollout_tries = 6  # RolloutClient.max_retries + 1
    bound = (config.rollout_startup_timeout_seconds + config.rollout_weight_sync_timeout_seconds
             + rollout_tries * config.rollout_request_timeout_seconds + 600)
    return max(COLLECTIVE_TIMEOUT_FLOOR_S, bound)


def init_distributed(timeout_s: float = COLLECTIVE_TIMEOUT_FLOOR_S) -> DistInfo:
    """Join the torchrun world (or a world of one when not started by torchrun)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, device)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from `src` to every rank; returns it everywhere."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
