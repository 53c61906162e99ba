"""Random [B, T] masks for the algorithm tests (one definition, imported by each file)."""

from __future__ import annotations

import torch


def random_mask(b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] float64 mask of random response lengths, with a one-token first row and an
    all-masked last row (the edge cases of every reduction)."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = 1
    lengths[-1] = 0
    return (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
