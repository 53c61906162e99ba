"""Gradient clipping by global norm for any mix of plain tensors and DTensors.

`torch.nn.utils.clip_grad_norm_` refuses a mix of plain and distributed gradients (pure
tensor parallel leaves norms and other replicated parameters as plain tensors) and of
DTensors on different meshes. Here each parameter's norm is computed on its own mesh and
made whole (`full_tensor`, a scalar), then the squares are summed: the same number on
every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    grads = [p.grad for p in parameters if p.grad is not None]
    total_sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        norm = g.norm()
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        total_sq += norm.double().cpu() ** 2
    total = float(total_sq.sqrt())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
