"""Receiving side of vLLM's weight-transfer protocol, over a gloo group on CPU.

The trainer is rank 0 of a group that it creates beside its own torchrun world; this
server (one worker) joins as rank `rank_offset`. Updates arrive as broadcasts from
rank 0 in the layout of vLLM's `packed_tensor.py`:

- packed: walk the metadata in order, adding each tensor's byte size to the current
  bucket; a bucket closes as soon as its size EXCEEDS `packed_buffer_size_bytes` (so a
  bucket may be larger than the buffer size), the rest forms the last bucket. Each
  bucket is one uint8 broadcast holding the tensors' bytes back to back.
- unpacked: one broadcast per tensor, with its own shape and dtype.

Departures from vLLM: gloo instead of NCCL (CPU); the metadata is checked against the
model BEFORE anything is received, and on a bad name or shape the broadcasts are still
received and dropped, so the trainer is not left hanging and the group stays usable.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # 1 GiB, as vLLM


class WeightUpdateError(ValueError):
    """A request the caller can fix (bad metadata); `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class InitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int

    @classmethod
    def parse(cls, raw: dict) -> InitInfo:
        try:
            return cls(str(raw["master_address"]), int(raw["master_port"]),
                       int(raw["rank_offset"]), int(raw["world_size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateError(
                "init_info needs master_address (str), master_port, rank_offset and "
                f"world_size (int): {exc!r}", "init_info") from exc


@dataclass(frozen=True)
class UpdateInfo:
    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    packed: bool
    packed_buffer_size_bytes: int

    @classmethod
    def parse(cls, raw: dict) -> UpdateInfo:
        try:
            names = [str(n) for n in raw["names"]]
            dtype_names = [str(d) for d in raw["dtype_names"]]
            shapes = [[int(x) for x in s] for s in raw["shapes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightUpdateError(
                f"update_info needs names, dtype_names and shapes lists: {exc!r}", "update_info"
            ) from exc
        if not (len(names) == len(dtype_names) == len(shapes)):
            raise WeightUpdateError(
                f"update_info: names ({len(names)}), dtype_names ({len(dtype_names)}) and "
                f"shapes ({len(shapes)}) must have the same length", "update_info")
        dtypes = []
        for name, dtype_name in zip(names, dtype_names):
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise WeightUpdateError(
                    f"update_info.dtype_names: unknown dtype {dtype_name!r} for {name}",
                    "update_info.dtype_names")
            dtypes.append(dtype)
        size = int(raw.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES))
        if size <= 0:
            raise WeightUpdateError("update_info.packed_buffer_size_bytes must be > 0",
                                    "update_info.packed_buffer_size_bytes")
        return cls(names, dtypes, shapes, bool(raw.get("packed", False)), size)

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize


def packed_buckets(sizes: list[int], buffer_size_bytes: int) -> Iterator[list[int]]:
    """Indices of each bucket: a bucket closes once its byte size exceeds the buffer."""
    bucket: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        bucket.append(i)
        total += size
        if total > buffer_size_bytes:
            yield bucket
            bucket, total = [], 0
    if bucket:
        yield bucket


class GlooGroup:
    """The transport: a gloo process group beside (or without) the default group."""

    def __init__(self, info: InitInfo, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = info.rank_offset
        self.world_size = info.world_size
        self.store = dist.TCPStore(info.master_address, info.master_port, info.world_size,
                                   is_master=False, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast(tensor, src).wait()


class WeightReceiver:
    """Joins the trainer's group and receives updates into a model's named tensors."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.group: GlooGroup | None = None

    def init(self, info: InitInfo) -> None:
        if not 0 < info.rank_offset < info.world_size:
            raise WeightUpdateError(
                f"init_info.rank_offset ({info.rank_offset}) must be in [1, world_size "
                f"({info.world_size})): rank 0 is the trainer", "init_info.rank_offset")
        self.group = GlooGroup(info, self.timeout_s)

    def receive(self, info: UpdateInfo, targets: dict[str, torch.Tensor],
                load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Receive every tensor of `info`; call `load` per bucket (or per tensor)."""
        if self.group is None:
            raise WeightUpdateError(
                "weight transfer not initialized: POST /init_weight_transfer_engine first",
                "init_info")
        problem = _check_against_model(info, targets)
        if problem is not None:
            load = lambda pairs: None  # noqa: E731  (drain the broadcasts, load nothing)
        if info.packed:
            sizes = [info.nbytes(i) for i in range(len(info.names))]
            for bucket in packed_buckets(sizes, info.packed_buffer_size_bytes):
                buffer = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
                self.group.broadcast(buffer, src=0)
                parts = buffer.split([sizes[i] for i in bucket])
                load([
                    (info.names[i], _as_tensor(part, info.dtypes[i], info.shapes[i]))
                    for i, part in zip(bucket, parts)
                ])
        else:
            for name, dtype, shape in zip(info.names, info.dtypes, info.shapes):
                tensor = torch.empty(shape, dtype=dtype)
                self.group.broadcast(tensor, src=0)
                load([(name, tensor)])
        if problem is not None:
            raise problem


def _as_tensor(part: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """View a slice of a uint8 bucket as `dtype` (copied when its offset is misaligned)."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).view(shape)


def _check_against_model(info: UpdateInfo, targets: dict[str, torch.Tensor]) -> WeightUpdateError | None:
    for name, shape in zip(info.names, info.shapes):
        if name not in targets:
            return WeightUpdateError(
                f"update_info.names: unknown parameter {name!r} (not in the served model)",
                "update_info.names")
        if list(targets[name].shape) != list(shape):
            return WeightUpdateError(
                f"update_info.shapes: parameter {name!r} has shape {list(targets[name].shape)} "
                f"in the served model, got {list(shape)}", "update_info.shapes")
    return None


@torch.no_grad()
def copy_into(targets: dict[str, torch.Tensor], pairs: list[tuple[str, torch.Tensor]]) -> None:
    """Copy received tensors into the model's tensors (casting dtype if they differ)."""
    for name, tensor in pairs:
        targets[name].copy_(tensor)
