"""vLLM's packed broadcast layout (vllm/distributed/weight_transfer/packed_tensor.py).

Tensors are taken in metadata order, each flattened to its raw bytes (uint8); a bucket
closes as soon as its byte size EXCEEDS the buffer size (so one bucket may be larger
than the buffer, and a single tensor larger than the buffer is a bucket of its own
with what preceded it), and whatever is left forms the last bucket. Each bucket is
broadcast as one uint8 tensor. Consumers (vLLM's, and the CPU engine's) rebuild the
same buckets from the metadata alone, so both sides must use the same buffer size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's `dtype_names` entry: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes as a flat CPU uint8 tensor."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def pack_buckets(byte_tensors: Iterable[torch.Tensor], buffer_size_bytes: int) -> Iterator[torch.Tensor]:
    """Concatenate flat uint8 tensors into buckets, closing one once it exceeds the size."""
    parts: list[torch.Tensor] = []
    total = 0
    for flat in byte_tensors:
        parts.append(flat)
        total += flat.numel()
        if total > buffer_size_bytes:
            yield torch.cat(parts)
            parts, total = [], 0
    if parts:
        yield torch.cat(parts)
