"""Gradient clipping by global norm for any mix of plain tensors and DTensors.

`torch.nn.utils.clip_grad_norm_` refuses a mix of plain and distributed gradients (pure
tensor parallel leaves norms and other replicated parameters as plain tensors) and of
DTensors on different meshes. Here gradients are grouped by (mesh, placements): each
group's local squares are summed on the device, then ONE all-reduce per sharded mesh
dimension of the group makes the sum whole (replicated dimensions need none). The total
stays a device tensor (no host sync); clipping multiplies in place by min(1, max / norm),
so a non-finite norm leaves the gradients alone and the caller skips the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Shard


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients (fp32 0-d tensor on their device)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total: torch.Tensor | None = None
    for key, grads in groups.items():
        if key is not None and any(isinstance(pl, Partial) for pl in key[1]):
            grads, key = [g.full_tensor() for g in grads], None  # pending sums: make them whole first
        local = [_local(g) for g in grads]
        sq = torch.stack([t.float().square().sum() for t in local]).sum()
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if isinstance(placement, Shard) and mesh.size(dim) > 1:
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        return torch.zeros(())
    return total.sqrt()


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
