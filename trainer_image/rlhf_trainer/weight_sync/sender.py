"""Trainer rank 0's side of a weight sync, speaking vLLM's HTTP weight-transfer API.

One round (`send`):
  1. POST /start_weight_update to every server (they pause between two steps);
  2. POST /update_weights {"update_info": {names, dtype_names, shapes, packed: true,
     packed_buffer_size_bytes}} to every server at once (each call blocks until that
     server has loaded everything) while this process broadcasts the packed buckets;
  3. POST /finish_weight_update {"weight_version"} (servers resume).
`init` forms the group once: world = 1 + the sum of every server's /get_world_size,
server i gets rank_offset = 1 + the sizes before it. Every parameter is sent every
round under its Hugging Face name.

The HTTP calls run on threads. The tensors are consumed and packed on the calling
thread (a trainer's generator may run collectives such as `full_tensor()`), and the
buckets are broadcast from a helper thread one bucket behind, so a server that answers
an error ends the round at once instead of leaving rank 0 blocked in a collective. The
group is kept when every bucket still went through (the CPU engine receives and drops
the buckets of an update it rejects); otherwise `group` is None and `init` must run
again (on a fresh port). After a failed round the servers stay paused (they may hold
partly loaded weights); the next successful `send` resumes them.
The transport is `transport.GlooBroadcastGroup` (CPU); NCCL is not done yet.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import httpx
import torch

from .packing import as_bytes, dtype_name, pack_buckets
from .transport import BroadcastGroup, GlooBroadcastGroup

DEFAULT_BUCKET_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES

GROUP_GRACE_S = 10.0  # after a failed round, how long to wait for the broadcasts to end

TensorMeta = tuple[str, list[int], torch.dtype]


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-sync call, or the group could not form."""


class WeightSyncSender:
    """Pushes full weights from trainer rank 0 to rollout servers (vLLM or the CPU engine).

    `endpoints` are base URLs (http://host:port); `listen_host:listen_port` is where
    rank 0 hosts the group's TCPStore, and the address the servers are told to join.
    `bucket_bytes` is the packed buffer size (both sides must agree; it is sent along).
    """

    def __init__(self, endpoints: list[str], listen_host: str, listen_port: int, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 group_factory: Callable[[str, int, int, float], BroadcastGroup] = GlooBroadcastGroup):
        if not endpoints:
            raise ValueError("weight sync needs at least one rollout endpoint")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group_factory = group_factory
        self.group: BroadcastGroup | None = None
        self.world_size: int | None = None
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0))
        self._pool = cf.ThreadPoolExecutor(max_workers=max(2, len(self.endpoints)),
                                           thread_name_prefix="weight-sync-http")

    # ---- HTTP ------------------------------------------------------------------

    def _call(self, method: str, endpoint: str, path: str, body: dict | None = None) -> dict:
        url = endpoint + path
        try:
            response = self._http.request(method, url, json=body)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise WeightSyncError(
                f"{method} {url} answered HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else {}

    def _call_all(self, path: str, bodies: list[dict | None]) -> list[cf.Future]:
        return [self._pool.submit(self._call, "POST", ep, path, body)
                for ep, body in zip(self.endpoints, bodies)]

    # ---- group -------------------------------------------------------------------

    def init(self) -> None:
        """Form the broadcast group with every server (blocks until all have joined)."""
        sizes = [int(self._call("GET", ep, "/get_world_size")["world_size"])
                 for ep in self.endpoints]
        self.world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        bodies = [{"init_info": {"master_address": self.listen_host,
                                 "master_port": self.listen_port,
                                 "rank_offset": offset, "world_size": self.world_size}}
                  for offset in offsets]
        replies = self._call_all("/init_weight_transfer_engine", bodies)
        created: list[BroadcastGroup] = []
        group_job = _run_in_thread(lambda: created.append(self.group_factory(
            self.listen_host, self.listen_port, self.world_size, self.timeout_s)))
        _wait_all(replies + [group_job], self.timeout_s)
        self.group = created[0]

    # ---- one round -----------------------------------------------------------------

    def send(self, metadata: list[TensorMeta], tensors: Iterator[torch.Tensor],
             weight_version: str | None = None) -> dict:
        """Push every tensor (yielded in `metadata` order) to every server.

        Returns {"bytes", "buckets", "num_tensors", "seconds"}.
        """
        if self.group is None:
            raise WeightSyncError("call init() before send()")
        metadata = [(name, [int(s) for s in shape], dtype) for name, shape, dtype in metadata]
        start = time.perf_counter()
        _wait_all(self._call_all("/start_weight_update", [None] * len(self.endpoints)),
                  self.timeout_s)
        update_info = {
            "names": [name for name, _, _ in metadata],
            "dtype_names": [dtype_name(dtype) for _, _, dtype in metadata],
            "shapes": [shape for _, shape, _ in metadata],
            "packed": True,
            "packed_buffer_size_bytes": self.bucket_bytes,
        }
        replies = self._call_all("/update_weights",
                                 [{"update_info": update_info}] * len(self.endpoints))
        stats = {"bytes": 0, "buckets": 0, "num_tensors": len(metadata)}
        broadcast: cf.Future | None = None
        try:
            broadcast = self._broadcast(self.group, metadata, tensors, stats, watch=replies)
            _wait_all([*replies, broadcast], self.timeout_s)
        except BaseException:
            # A server that rejects an update still receives (and drops) every bucket, so
            # the group stays usable once all broadcasts are through; otherwise it is not.
            if broadcast is None or not _succeeds(broadcast, GROUP_GRACE_S):
                self.group = None
            raise
        _wait_all(self._call_all("/finish_weight_update",
                                 [{"weight_version": weight_version}] * len(self.endpoints)),
                  self.timeout_s)
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _broadcast(self, group: BroadcastGroup, metadata: list[TensorMeta],
                   tensors: Iterable[torch.Tensor], stats: dict,
                   watch: list[cf.Future]) -> cf.Future:
        """Pack on this thread (the generator may run collectives of its own) and
        broadcast on a helper thread one bucket behind, so packing overlaps sending and
        a failed server reply is noticed while a broadcast is blocked. Returns the
        helper's future (done once every bucket is sent)."""
        ready: queue.Queue[torch.Tensor | None] = queue.Queue(maxsize=1)

        def send_buckets() -> None:
            while (bucket := ready.get()) is not None:
                group.broadcast(bucket, src=0)
                stats["bytes"] += bucket.numel()
                stats["buckets"] += 1

        helper = _run_in_thread(send_buckets)
        deadline = time.monotonic() + self.timeout_s
        try:
            for bucket in pack_buckets(_checked_bytes(metadata, tensors), self.bucket_bytes):
                _put_watching(ready, bucket, [*watch, helper], deadline)
        except BaseException:
            with contextlib.suppress(queue.Full):
                ready.put(None, timeout=1.0)  # let the helper thread end if it can
            raise
        _put_watching(ready, None, [helper], deadline)
        return helper

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> WeightSyncSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked_bytes(metadata: list[TensorMeta], tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Each tensor's bytes, after checking it matches its metadata entry."""
    iterator = iter(tensors)
    for name, shape, dtype in metadata:
        try:
            tensor = next(iterator)
        except StopIteration:
            raise WeightSyncError(f"tensors ended before {name!r}: the generator must yield "
                                  "one tensor per metadata entry, in order") from None
        if list(tensor.shape) != shape or tensor.dtype != dtype:
            raise WeightSyncError(
                f"tensor for {name!r} is {tuple(tensor.shape)} {tensor.dtype}, metadata says "
                f"{tuple(shape)} {dtype}")
        flat = as_bytes(tensor)
        assert flat.numel() == math.prod(shape) * dtype.itemsize
        yield flat
    if next(iterator, None) is not None:
        raise WeightSyncError("tensors yielded more tensors than metadata has entries")


def _succeeds(future: cf.Future, timeout_s: float) -> bool:
    """Whether `future` ends without error within `timeout_s`."""
    try:
        future.result(timeout=timeout_s)
    except BaseException:
        return False
    return True


def _put_watching(q: queue.Queue, item, watch: list[cf.Future], deadline: float) -> None:
    """q.put(item), but raise at once if a watched future fails or the deadline passes."""
    while True:
        for future in watch:
            if future.done() and future.exception() is not None:
                raise future.exception()
        if time.monotonic() > deadline:
            raise WeightSyncError("weight sync timed out while broadcasting")
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _run_in_thread(fn: Callable[[], None]) -> cf.Future:
    """Run fn on a daemon thread (it may block in a collective that never completes)."""
    future: cf.Future = cf.Future()

    def target():
        try:
            fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=target, daemon=True, name="weight-sync-group").start()
    return future


def _wait_all(futures: list[cf.Future], timeout_s: float) -> list:
    """Wait for every future; raise the first error as soon as it happens."""
    done, pending = cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()
    if pending:
        raise WeightSyncError(f"weight sync timed out after {timeout_s} s")
    return [f.result() for f in futures]
