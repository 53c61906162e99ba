"""CUDA IPC weight transfer: for rollout servers on the trainer's own GPUs
(`rollout.placement: colocated` with vLLM, served with `--weight-transfer-config
'{"backend":"ipc"}'`). Two processes on one GPU cannot share an NCCL communicator
("Duplicate GPU detected"), so nothing is broadcast: the servers map the trainer's packed
buffers and copy out of them.

vLLM 0.33's `ipc` engine (vllm/distributed/weight_transfer/ipc_engine.py, packed_tensor.py), over
its HTTP routes, in the same order as the NCCL rounds (sender.py):

- `/init_weight_transfer_engine` with `init_info = {"packed": true}` (its
  `IPCWeightTransferInitInfo` has no other field);
- per round `/pause`, `/start_weight_update`, then ONE `/update_weights` per bucket, then
  `/finish_weight_update`, `/reset_prefix_cache`, `/resume`;
- a bucket's `update_info`: the names, dtype names and shapes of the tensors packed in it,
  `tensor_sizes` (their bytes, in order: vLLM splits the buffer by them, `unpack_tensor`),
  and `ipc_handles_pickled`, base64 of the pickled `{GPU UUID: rebuild_cuda_tensor args}` of
  the bucket, one entry per trainer GPU. Each vLLM worker looks up ITS GPU's UUID, so every
  trainer rank packs the same bucket on its own GPU and exports it, and rank 0 sends the
  gathered handles (a server of tensorParallelSize 2 on GPUs 2 and 3 maps the buckets of
  trainer ranks 2 and 3). vLLM unpickles only with VLLM_ALLOW_INSECURE_SERIALIZATION=1:
  the colocated servers listen on loopback only (rlhf_contract.pod).
- vLLM clones each tensor out of the mapped buffer before `/update_weights` answers, so
  once every server has answered, every rank may refill its buffer (a barrier); after the
  round `torch.cuda.ipc_collect()` frees what the servers released.

Buckets close by the rule of buckets.py `pack_buckets` (once a bucket EXCEEDS the size),
which its `bucket_ranges` repeats from the sizes alone: rank 0 knows which names each bucket
holds from the metadata.
"""

from __future__ import annotations

import base64
import math
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .buckets import BufferRing, bucket_ranges, checked_bytes, dtype_name, pack_buckets

IPC_BACKEND = "ipc"


def init_info() -> dict:
    """The `init_info` of /init_weight_transfer_engine for the ipc engine."""
    return {"packed": True}


def update_info(metadata: list[tuple[str, list[int], torch.dtype]], handles: dict[str, tuple]) -> dict:
    """One bucket's `update_info`: its tensors' (name, shape, wire dtype), in packing order,
    and the handles of its buffer by GPU UUID."""
    return {
        "names": [name for name, _, _ in metadata],
        "dtype_names": [dtype_name(dtype) for _, _, dtype in metadata],
        "shapes": [list(shape) for _, shape, _ in metadata],
        "tensor_sizes": [math.prod(shape) * dtype.itemsize for _, shape, dtype in metadata],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    }


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's UUID, as vLLM's workers name theirs (`str(props.uuid)`)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export(bucket: torch.Tensor) -> tuple:
    """The `rebuild_cuda_tensor` arguments of `bucket` (torch's own CUDA IPC reduction)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(bucket)[1]


@dataclass(frozen=True)
class IpcSync:
    """What every trainer rank needs for an IPC round: the dtype weights travel in (the
    servers' serving dtype; None: as the trainer holds them) and the bucket size."""

    wire_dtype: torch.dtype | None
    bucket_bytes: int

    def wire(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dtype.is_floating_point else dtype


def _gather_handles(handle: tuple[str, tuple]) -> dict[str, tuple]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict([handle])
    handles: list = [None] * dist.get_world_size()
    dist.all_gather_object(handles, handle)
    return dict(handles)


def push_ipc(engine, sender, sync: IpcSync, *, weight_version: str) -> dict:
    """Collective over the trainer world: every rank gathers each full tensor (the engine's
    `full_tensors`), packs it into buckets on its own GPU and exports each bucket; rank 0
    (`sender` not None) sends each bucket's handles to every server and waits for their
    answers; then every rank may reuse its buffer. Returns rank 0's round statistics."""
    start = time.perf_counter()
    specs, tensors = engine.full_tensors()
    source = [(name, [int(s) for s in shape], dtype) for name, shape, dtype in specs]
    wire = [(name, shape, sync.wire(dtype)) for name, shape, dtype in source]
    ranges = bucket_ranges([math.prod(shape) * dtype.itemsize for _, shape, dtype in wire], sync.bucket_bytes)
    device = torch.device("cuda", torch.cuda.current_device())
    uuid = gpu_uuid(device)
    ring = BufferRing(device, count=1)  # refilled only after every server has copied the bucket out
    stats = {"bytes": 0, "buckets": 0, "num_tensors": len(wire)}
    if sender is not None:
        sender.begin_ipc_round()
    buckets = pack_buckets(checked_bytes(source, tensors, device, wire), sync.bucket_bytes, ring)
    for members, bucket in zip(ranges, buckets, strict=True):
        torch.cuda.current_stream(device).synchronize()  # the bytes are in the buffer before a server maps it
        handles = _gather_handles((uuid, export(bucket)))
        if sender is not None:
            sender.send_ipc_bucket(update_info(wire[members.start:members.stop], handles))
            stats["bytes"] += bucket.numel()
            stats["buckets"] += 1
        if dist.is_initialized():
            dist.barrier()  # every server has cloned this bucket: the buffers may be refilled
    if sender is not None:
        sender.end_ipc_round(weight_version)
    del ring, buckets
    torch.cuda.ipc_collect()
    stats["seconds"] = time.perf_counter() - start
    return stats


class IpcRounds:
    """Rank 0's side of an IPC round, mixed into `WeightSyncSender` (its HTTP helpers and
    its deadline): the calls around the buckets, and one /update_weights per bucket."""

    def begin_ipc_round(self) -> None:
        self.calls, self.phase_seconds = [], {}
        self._round_deadline = time.monotonic() + self.timeout_s
        self._guarded(lambda: (self._all("/pause", params={"mode": "wait"}, deadline=self._round_deadline),
                               self._all("/start_weight_update", deadline=self._round_deadline)))

    def send_ipc_bucket(self, info: dict) -> None:
        self._guarded(lambda: self._all("/update_weights", [{"update_info": info}] * len(self.endpoints),
                                        deadline=self._round_deadline))

    def end_ipc_round(self, weight_version: str | None) -> None:
        version = None if weight_version is None else str(weight_version)

        def finish() -> None:
            self._all("/finish_weight_update", [{"weight_version": version}] * len(self.endpoints),
                      deadline=self._round_deadline)
            self._reset_prefix_caches(self._round_deadline)
            self._all("/resume", deadline=self._round_deadline)
        self._guarded(finish)

    def _guarded(self, call) -> None:
        from .threads import WeightSyncError

        try:
            call()
        except BaseException as exc:
            self._sent_metadata = None
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync (CUDA IPC) failed: {exc!r}") from exc
