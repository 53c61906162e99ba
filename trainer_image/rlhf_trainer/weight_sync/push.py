"""One weight sync from the trainer's side of the world: every trainer process gathers
each full tensor of its (sharded) policy in turn (`DTensor.full_tensor()` is collective),
and rank 0, the one holding the sender, streams them to the rollout servers. Every
parameter, Hugging Face names, every round, as the policy's engine gives them
(engine/base.py `full_tensors`: with LoRA adapters the merged weights, so the servers need
no LoRA support)."""

from __future__ import annotations

import time

import torch.distributed as dist

from ..engine import Engine
from .sender import WeightSyncSender


def push_weights(engine: Engine, sender: WeightSyncSender | None, *, weight_version: str) -> float:
    """Collective over the trainer world: gather the full tensors of the `engine`'s model;
    the rank with a `sender` sends them. Returns the seconds it took (barrier included)."""
    start = time.perf_counter()
    specs, full_tensors = engine.full_tensors()
    if sender is not None:
        sender.send(specs, full_tensors, weight_version=weight_version)
    else:
        for _ in full_tensors:
            pass
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start
