"""One weight sync from the trainer's side of the world: every trainer process gathers
each full tensor of its (sharded) policy in turn (`DTensor.full_tensor()` is collective),
and rank 0, the one holding the sender, streams them to the rollout servers. Every
parameter, Hugging Face names, every round, as the policy's engine gives them
(engine/base.py `full_tensors`: with LoRA adapters the merged weights, so the servers need
no LoRA support)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from ..engine import Engine
from .ipc import IPC_BACKEND, IpcSync, push_ipc
from .sender import WeightSyncError, WeightSyncSender


def ipc_sync(sender: WeightSyncSender | None) -> IpcSync | None:
    """Collective, after rank 0's `sender.init()`: every rank learns whether the servers take
    weights by CUDA IPC (then every rank sends: ipc.py) and in which dtype; None: rank 0
    alone sends (NCCL, gloo)."""
    said = [None if sender is None else (sender.backend, sender.serving_dtype, sender.bucket_bytes)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(said, src=0)
    backend, dtype, bucket_bytes = said[0]
    return IpcSync(dtype, bucket_bytes) if backend == IPC_BACKEND else None


def push_weights(engine: Engine, sender: WeightSyncSender | None, *, weight_version: str,
                 ipc: IpcSync | None = None, recover: Callable[[WeightSyncError], bool] | None = None) -> float:
    """Collective over the trainer world: gather the full tensors of the `engine`'s model;
    the rank with a `sender` sends them (with `ipc`, every rank exports them: ipc.py).
    With `recover` (given on every rank or none; rl/replacement.py), a failed round is
    asked to it on rank 0: True (the group re-formed) and every rank gathers again for one
    more round; False re-raises. Returns the seconds it took (barrier included)."""
    start = time.perf_counter()
    if ipc is not None:
        push_ipc(engine, sender, ipc, weight_version=weight_version)
        return time.perf_counter() - start
    while True:
        specs, full_tensors = engine.full_tensors()
        failed = None
        try:
            if sender is not None:
                sender.send(specs, full_tensors, weight_version=weight_version)
        except WeightSyncError as exc:
            if recover is None:
                raise
            failed = exc
        for _ in full_tensors:  # the other ranks' gathers go on: this rank takes part to the end
            pass
        if recover is None:
            break
        again = [failed is not None and recover(failed)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(again, src=0)
        if failed is not None and not again[0]:
            raise failed
        if not again[0]:
            break
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start
