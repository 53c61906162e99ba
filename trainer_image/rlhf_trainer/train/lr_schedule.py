"""Learning-rate schedules over optimizer steps: linear warmup from 0, then constant,
linear or cosine decay to `min_ratio x peak` at the last step (as TRL and OpenRLHF offer).
A pure function of the step, so a resumed run needs no scheduler state."""

from __future__ import annotations

import math


def lr_factor(step: int, *, total: int, warmup: int = 0, kind: str = "constant", min_ratio: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0-based) of `total`, as a fraction of
    the peak (the configured learning rate)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(total - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if kind == "linear":
        factor = 1.0 - progress
    elif kind == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"trainer.lrScheduler: unknown schedule {kind!r}; use constant, linear or cosine")
    return min_ratio + (1.0 - min_ratio) * factor
