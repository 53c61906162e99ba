"""Gradient clipping by global norm for any mix of plain tensors and DTensors.

`torch.nn.utils.clip_grad_norm_` refuses a mix of plain and distributed gradients (pure
tensor parallel leaves norms and other replicated parameters as plain tensors) and of
DTensors on different meshes. Here each gradient's norm is made whole on its own mesh and
the squares are summed on the device. The total stays a device tensor (no host sync;
one small all-reduce per distributed parameter remains); clipping multiplies in place by min(1, max / norm),
so a non-finite norm leaves the gradients alone and the caller skips the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(g: torch.Tensor) -> torch.Tensor:
    """The local shard itself (not a copy: clipping scales it in place). `to_local()` may
    return a new tensor for strided shards (FSDP over TP), so read the attribute."""
    return g._local_tensor if isinstance(g, DTensor) else g


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients (fp32 0-d tensor on their device): each
    distributed gradient's norm is made whole on its own mesh (`full_tensor` of a scalar),
    the squares are summed on the device."""
    total: torch.Tensor | None = None
    for p in parameters:
        if p.grad is None:
            continue
        norm = p.grad.norm()
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq = norm.float().square()
        total = sq if total is None else total + sq.to(total.device)
    return torch.zeros(()) if total is None else total.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients to `max_norm` in place; returns the norm before clipping (a
    device tensor: `torch.isfinite(norm)` tells whether the step may be applied)."""
    params = [p for p in parameters if p.grad is not None]
    norm = grad_norm(params)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    coef = torch.where(torch.isfinite(coef), coef, torch.ones_like(coef))
    for p in params:
        local = _local(p.grad)
        local.mul_(coef.to(local.device, local.dtype))
    return norm
