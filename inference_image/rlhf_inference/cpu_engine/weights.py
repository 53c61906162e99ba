"""Receiving side of vLLM's weight-transfer protocol, over a gloo group on CPU.

Mirrors the pinned vLLM release's NCCL engine (`vllm/distributed/weight_transfer/
nccl_engine.py`, `nccl_common.py`, `packed_tensor.py`), checked by tests/protocol/:

- `init_info` has exactly the fields of vLLM's `NCCLWeightTransferInitInfo` (keyword
  only; an unknown key is an error, as vLLM's `parse_init_info`); the packed settings
  (`packed`, `packed_buffer_size_bytes`, `packed_num_buffers`) are read HERE, at the
  handshake, never from `update_info`.
- `update_info` has exactly `names`, `dtype_names`, `shapes` (vLLM's
  `NCCLWeightTransferUpdateInfo`); all three empty reuse the previous update's metadata.
- packed: walk the metadata in order, adding each tensor's byte size to the current
  bucket; a bucket closes as soon as its size EXCEEDS `packed_buffer_size_bytes`, the
  rest forms the last bucket; each bucket is one uint8 broadcast holding the tensors'
  bytes back to back. Unpacked: one broadcast per tensor.

Departures from vLLM: gloo instead of NCCL (CPU), so only the TCP rendezvous
(`master_address` + `master_port`) is accepted, not `nccl_unique_id_b64`; one worker
(world size 1 per server); the metadata is checked against the model BEFORE anything is
received, and on a bad name or shape the broadcasts are still received and dropped, so
the trainer is not left hanging in a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024  # 1 GiB, as vLLM
DEFAULT_PACKED_NUM_BUFFERS = 2  # as vLLM (CUDA streams there; no effect on the layout)


class WeightUpdateError(ValueError):
    """A request the caller can fix (bad metadata); `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _parse(cls, raw, what: str):
    """`cls(**raw)` as vLLM's parse_init_info / parse_update_info: unknown or missing
    keys are an error naming the request field."""
    if not isinstance(raw, dict):
        raise WeightUpdateError(f"{what} must be a JSON object, got {type(raw).__name__}", what)
    try:
        return cls(**raw)
    except TypeError as exc:
        allowed = ", ".join(f.name for f in dataclasses.fields(cls))
        raise WeightUpdateError(f"Invalid {what}: {exc} (allowed keys: {allowed})", what) from exc


@dataclass(kw_only=True)
class InitInfo:
    """vLLM's NCCLWeightTransferInitInfo, field for field."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = field(default=None, repr=False)
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    @classmethod
    def parse(cls, raw) -> InitInfo:
        info = _parse(cls, raw, "init_info")
        if info.nccl_unique_id_b64:
            raise WeightUpdateError("init_info.nccl_unique_id_b64: the CPU engine joins over gloo; pass "
                                    "master_address and master_port instead", "init_info.nccl_unique_id_b64")
        if info.master_address is None or info.master_port is None:
            raise WeightUpdateError("init_info needs both master_address and master_port (got "
                                    f"master_address={info.master_address!r}, master_port={info.master_port!r})",
                                    "init_info.master_address")
        for name in ("master_port", "rank_offset", "world_size", "packed_buffer_size_bytes", "packed_num_buffers"):
            value = getattr(info, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise WeightUpdateError(f"init_info.{name} must be an integer, got {value!r}", f"init_info.{name}")
        if info.packed_buffer_size_bytes <= 0:
            raise WeightUpdateError("init_info.packed_buffer_size_bytes must be > 0",
                                    "init_info.packed_buffer_size_bytes")
        return info


@dataclass
class UpdateInfo:
    """vLLM's NCCLWeightTransferUpdateInfo, field for field (plus the parsed dtypes)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if len(self.dtype_names) != len(self.names):
            raise WeightUpdateError(f"`dtype_names` should be of the same size as `names`: got "
                                    f"{len(self.dtype_names)} and {len(self.names)}", "update_info.dtype_names")
        if len(self.shapes) != len(self.names):
            raise WeightUpdateError(f"`shapes` should be of the same size as `names`: got "
                                    f"{len(self.shapes)} and {len(self.names)}", "update_info.shapes")
        self.dtypes: list[torch.dtype] = []
        for name, dtype_name in zip(self.names, self.dtype_names):
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise WeightUpdateError(f"update_info.dtype_names: unknown dtype {dtype_name!r} for {name}",
                                        "update_info.dtype_names")
            self.dtypes.append(dtype)
        try:
            self.shapes = [[int(x) for x in shape] for shape in self.shapes]
        except (TypeError, ValueError) as exc:
            raise WeightUpdateError(f"update_info.shapes must be lists of integers: {exc}",
                                    "update_info.shapes") from exc

    @classmethod
    def parse(cls, raw) -> UpdateInfo:
        return _parse(cls, raw, "update_info")

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
        self.info: InitInfo | None = None
        self.last_update: UpdateInfo | None = None
        # reused receive buffers (no allocation and page faults per bucket): one being
        # received, one queued for loading, one being loaded
        self._buffers: list[torch.Tensor | None] = [None] * 3

    def init(self, info: InitInfo) -> None:
        if not 0 < info.rank_offset < info.world_size:
            raise WeightUpdateError(
                f"init_info.rank_offset ({info.rank_offset}) must be in [1, world_size "
                f"({info.world_size})): rank 0 is the trainer", "init_info.rank_offset")
        self.shutdown()
        self.group = GlooGroup(info, self.timeout_s)
        self.info = info

    def shutdown(self) -> None:
        self.group = self.info = self.last_update = None

    def receive(self, info: UpdateInfo, targets: dict[str, torch.Tensor],
                load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Receive every tensor of `info`; call `load` per bucket (or per tensor)."""
        if self.group is None or self.info is None:
            raise RuntimeError("Weight transfer not initialized: POST /init_weight_transfer_engine first")
        if info.names:
            self.last_update = info
        elif self.last_update is not None:
            info = self.last_update
        problem = _check_against_model(info, targets)
        if problem is not None:
            load = lambda pairs: None  # noqa: E731  (drain the broadcasts, load nothing)
        if self.info.packed:
            self._receive_packed(info, load)
        else:
            for name, dtype, shape in zip(info.names, info.dtypes, info.shapes):
                tensor = torch.empty(shape, dtype=dtype)
                self.group.broadcast(tensor, src=0)
                load([(name, tensor)])
        if problem is not None:
            raise problem

    def _receive_packed(self, info: UpdateInfo, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        """Receive bucket k+1 while a loader thread copies bucket k into the model."""
        sizes = [info.nbytes(i) for i in range(len(info.names))]
        ready: queue.Queue = queue.Queue(maxsize=1)
        errors: list[BaseException] = []

        def loader() -> None:
            while (item := ready.get()) is not None:
                bucket, buffer = item
                if errors:
                    continue
                try:
                    parts = buffer.split([sizes[i] for i in bucket])
                    load([(info.names[i], _as_tensor(part, info.dtypes[i], info.shapes[i]))
                          for i, part in zip(bucket, parts)])
                except BaseException as exc:  # raised on the receiving thread below
                    errors.append(exc)

        thread = threading.Thread(target=loader, name="weight-loader", daemon=True)
        thread.start()
        try:
            for k, bucket in enumerate(packed_buckets(sizes, self.info.packed_buffer_size_bytes)):
                nbytes = sum(sizes[i] for i in bucket)
                slot = k % len(self._buffers)
                if self._buffers[slot] is None or self._buffers[slot].numel() < nbytes:
                    self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8)
                buffer = self._buffers[slot][:nbytes]
                self.group.broadcast(buffer, src=0)
                ready.put((bucket, buffer))  # waits until the loader took the previous bucket
        finally:
            ready.put(None)
            thread.join()
        if errors:
            raise errors[0]


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
