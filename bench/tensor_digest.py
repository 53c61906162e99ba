"""One checksum for every part of `make gpu-check` that moves weights (pair, its receiver,
ipc): the sha256 of a tensor's bytes as they lie in memory. Read as bytes, not as numbers,
so one flipped bit of a bf16 weight shows, and -0.0 and 0.0 differ."""

from __future__ import annotations

import hashlib


def sha256(tensor) -> str:
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()
