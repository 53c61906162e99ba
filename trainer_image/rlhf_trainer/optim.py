"""The optimizer side shared by every method: AdamW over a model's trainable parameters,
learning-rate schedules as a pure function of the optimizer step, and the skeleton of one
optimizer step (`optimizer_step`) that the RL and offline loops both run (the engines of
engine/ step, clip and skip).

Schedules: linear warmup from 0, then constant, linear or cosine decay to
`min_ratio x peak` at the last step (as TRL and OpenRLHF offer). A pure function of the
step, so a resumed run needs no scheduler state; the optimizer's base rate is kept in
each parameter group's `initial_lr` and scaled per step (engine/base.py `scale_lr`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch


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


def schedule_factor(optim, step: int, total: int) -> float:
    """`lr_factor` of optimizer step `step` of `total` under the trainer config's `optim`."""
    return lr_factor(step, total=total, warmup=optim.warmup_steps, kind=optim.lr_scheduler,
                     min_ratio=optim.min_learning_rate_ratio)


def adamw(model: torch.nn.Module, optim, learning_rate: float | None = None) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters (the trainer config's `optim`): the fused
    kernel when they are all on CUDA (DTensors included, on any mix of meshes: torch
    registers a sharding rule for `_fused_adamw_`), the multi-tensor (foreach) one
    otherwise. DTensor's multi-tensor kernels refuse a mix of plain tensors and DTensors
    (pure TP on CPU leaves the norms plain; on CUDA FSDP2 makes every parameter a
    DTensor): such a mix steps one parameter at a time."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    uniform = len({isinstance(p, DTensor) for p in params}) == 1
    fused = uniform and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, lr=learning_rate or optim.learning_rate, weight_decay=optim.weight_decay,
                             fused=fused, foreach=uniform and not fused)


def optimizer_step(parts: Sequence[tuple[Any, str]], micro_batches: Sequence, run_micro: Callable[[Any, bool], None],
                   *, max_grad_norm: float, acc, lr_factor: float | None = None) -> None:
    """One optimizer step of every (engine, grad-norm metric) in `parts`: each engine's rate
    set to `lr_factor` x its base rate (None: left as it is) and its gradients dropped;
    `run_micro(mb, last)` runs each micro-batch's forwards and backwards (`last`: the step's
    last, DeepSpeed's accumulation boundary); then each engine clips to `max_grad_norm` and
    steps, its norm added to `acc` under its metric, or a non-finite norm counted in
    `skipped_steps` (the engine skipped the step)."""
    for engine, _ in parts:
        if lr_factor is not None:
            engine.scale_lr(lr_factor)
        engine.zero_grad()
    for j, mb in enumerate(micro_batches):
        run_micro(mb, j == len(micro_batches) - 1)
    for engine, metric in parts:
        norm = engine.step_or_skip(max_grad_norm)
        if norm is not None:
            acc.add(metric, norm)
        else:
            acc.add("skipped_steps", 1.0)
