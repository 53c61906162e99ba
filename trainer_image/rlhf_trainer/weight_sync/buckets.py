"""The packed bucket layout of vLLM's NCCL weight transfer (its `packed_tensor.py`).

Tensors are taken in metadata order, each flattened to its raw bytes (uint8); a bucket
closes as soon as its byte size EXCEEDS the buffer size (so a bucket may be larger than
the buffer, and a tensor larger than the buffer ends the bucket it joins), and whatever
is left forms the last bucket. Each bucket is broadcast as one uint8 tensor. The
receivers (vLLM's `packed_nccl_broadcast_consumer`, the CPU engine's) cut the same buckets
from the metadata alone, so both sides must use the same buffer size: it travels in
`init_info.packed_buffer_size_bytes`. `tests/protocol/` checks this layout against the
pinned vLLM release's own `pack_tensors`.

Buckets are built on the transport's device (the trainer's GPU for NCCL, the CPU for
gloo): a tensor already there is never staged elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from .threads import WeightSyncError

TensorMeta = tuple[str, list[int], torch.dtype]
"""(name, shape, dtype) of one tensor of a round."""

DEFAULT_BUCKET_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's `dtype_names` entry: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def as_bytes(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor's raw bytes as a flat uint8 tensor on `device` (no copy when already
    there and contiguous)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def bucket_ranges(sizes: list[int], buffer_size_bytes: int) -> list[range]:
    """The index range of each bucket, for tensors of `sizes` bytes in order."""
    buckets, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            buckets.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


class BufferRing:
    """`count` reusable uint8 buffers on one device, handed out in turn and grown as
    needed. Reusing them spares a fresh allocation (and, on the CPU, page faults on
    every byte) per bucket. A buffer is handed out again `count` buckets later, so the
    consumer must be done with a bucket by then (the sender keeps at most 3 alive)."""

    def __init__(self, device: torch.device | str, count: int = 3):
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.turn = 0

    def take(self, nbytes: int) -> torch.Tensor:
        i = self.turn
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.buffers[i] is None or self.buffers[i].numel() < nbytes:
            self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.buffers[i][:nbytes]


def pack_buckets(byte_tensors: Iterable[torch.Tensor], buffer_size_bytes: int,
                 ring: BufferRing | None = None) -> Iterator[torch.Tensor]:
    """Concatenate flat uint8 tensors into buckets, closing one once it exceeds the size.

    A bucket of one tensor is that tensor itself (no copy); with `ring`, the others are
    written into its reused buffers."""
    def cat(parts: list[torch.Tensor], total: int) -> torch.Tensor:
        if len(parts) == 1:
            return parts[0]
        out = ring.take(total) if ring is not None else torch.empty(total, dtype=torch.uint8, device=parts[0].device)
        offset = 0
        for part in parts:  # one copy_ per tensor: torch.cat on uint8 measured up to 50x slower here
            out[offset:offset + part.numel()].copy_(part)
            offset += part.numel()
        return out

    parts: list[torch.Tensor] = []
    total = 0
    for flat in byte_tensors:
        parts.append(flat)
        total += flat.numel()
        if total > buffer_size_bytes:
            yield cat(parts, total)
            parts, total = [], 0
    if parts:
        yield cat(parts, total)


def checked_bytes(metadata: list[TensorMeta], tensors: Iterable[torch.Tensor],
                   device: torch.device, wire: list[TensorMeta] | None = None) -> Iterator[torch.Tensor]:
    """Each tensor's bytes on `device`, after checking it matches its metadata entry, cast
    to its `wire` entry's dtype (on `device`, so a GPU casts what it gathered)."""
    iterator = iter(tensors)
    for i, (name, shape, dtype) in enumerate(metadata):
        try:
            tensor = next(iterator)
        except StopIteration:
            raise WeightSyncError(f"tensors ended before {name!r}: the generator must yield "
                                  "one tensor per metadata entry, in order") from None
        if list(tensor.shape) != shape or tensor.dtype != dtype:
            raise WeightSyncError(
                f"tensor for {name!r} is {tuple(tensor.shape)} {tensor.dtype}, metadata says "
                f"{tuple(shape)} {dtype}")
        target = wire[i][2] if wire is not None else dtype
        if target != dtype:
            tensor = tensor.detach().to(device=device, dtype=target)
        flat = as_bytes(tensor, device)
        assert flat.numel() == math.prod(shape) * target.itemsize
        yield flat
    if next(iterator, None) is not None:
        raise WeightSyncError("tensors yielded more tensors than metadata has entries")
