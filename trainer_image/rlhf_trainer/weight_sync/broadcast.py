"""The data plane of one weight-sync round (sender.py `send`): tensors packed into buckets
on the calling thread, broadcast from a helper thread one bucket behind."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
from collections.abc import Iterable, Iterator

import torch

from . import nccl
from .buckets import BufferRing, TensorMeta, checked_bytes, pack_buckets
from .threads import put_watching, raise_failed, run_in_thread
from .transport import Transport


def broadcast_buckets(group: Transport, source: list[TensorMeta], metadata: list[TensorMeta],
                      tensors: Iterable[torch.Tensor], stats: dict, bucket_bytes: int, *, watch: list[cf.Future],
                      deadline: float) -> cf.Future:
    """Pack on this thread (the generator may run collectives of its own) and broadcast on
    a helper thread one bucket behind, so packing overlaps sending and a failed server reply
    (a future of `watch`) is noticed while a broadcast is blocked. Counts bytes and buckets
    into `stats`. Returns the helper's future (done once every bucket is sent and completed)."""
    ready: queue.Queue[torch.Tensor | None] = queue.Queue(maxsize=1)
    if group.device.type == "cuda":
        group.use_stream(torch.cuda.current_stream(group.device))  # the stream buckets are packed on

    def send_buckets() -> None:
        while True:
            try:
                bucket = ready.get(timeout=nccl.POLL_S)
            except queue.Empty:
                group.check()  # a peer gone while the next bucket is packed ends the round now
                continue
            if bucket is None:
                break
            group.broadcast(bucket)
            stats["bytes"] += bucket.numel()
            stats["buckets"] += 1
        group.synchronize()

    helper = run_in_thread(send_buckets)
    # 3 buffers: one being broadcast, one in the queue, one being filled; this round's
    # only (freed when it ends: between rounds the memory belongs to training)
    ring = BufferRing(group.device, count=3)

    def watched(flats: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
        for flat in flats:  # a failure ends the round before the bucket fills (1 GiB of gathers)
            raise_failed([*watch, helper])
            yield flat

    try:
        for bucket in pack_buckets(watched(checked_bytes(source, tensors, group.device, metadata)), bucket_bytes,
                                   ring):
            put_watching(ready, bucket, [*watch, helper], deadline)
    except BaseException:
        with contextlib.suppress(queue.Full):
            ready.put(None, timeout=1.0)  # let the helper thread end if it can
        raise
    put_watching(ready, None, [helper], deadline)
    return helper
