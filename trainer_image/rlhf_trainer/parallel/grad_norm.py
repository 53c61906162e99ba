"""Gradient clipping by global norm for any mix of plain tensors and DTensors.

`torch.nn.utils.clip_grad_norm_` refuses a mix of plain and distributed gradients (pure
tensor parallel leaves norms and other replicated parameters as plain tensors) and of
DTensors on different meshes. Here the squared norms of the local shards are summed on
the device, grouped by the process groups the gradient is split over (the mesh
dimensions where its placement is `Shard` or `_StridedShard`; a `Replicate` dimension
holds copies and is not summed). Then one all-reduce per distinct process group sums every
group that needs it, stacked: FSDP alone is one all-reduce, TP alone one, FSDP over TP two
(the dp and the tp group), whatever the number of parameters. Plain gradients (replicated,
or one process) are summed without a collective.

The total stays a device tensor (no host sync); clipping multiplies in place by
min(1, max / norm), so a non-finite norm leaves the gradients alone and the caller skips
the step (a NaN or inf on one rank reaches every rank through the sums).

Not handled by the grouping: a `Partial` gradient (none in our layouts) is made whole
with one collective of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _local(g: torch.Tensor) -> torch.Tensor:
    """The local shard itself (not a copy: clipping scales it in place). `to_local()` may
    return a new tensor for strided shards (FSDP over TP), so read the attribute."""
    return g._local_tensor if isinstance(g, DTensor) else g


def _split_over(g: DTensor) -> tuple[dist.ProcessGroup, ...] | None:
    """The process groups of the mesh dimensions `g` is sharded over (size-1 dimensions
    left out); None when a placement is neither a shard nor a replica (`Partial`).
    (`_StridedShard.is_shard()` is False, hence the isinstance.)"""
    groups = []
    for dim, placement in enumerate(g.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            if g.device_mesh.size(dim) > 1:
                groups.append(g.device_mesh.get_group(dim))
        elif not isinstance(placement, Replicate):
            return None
    return tuple(groups)


@torch.no_grad()
def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients (fp32 0-d tensor on their device).

    Local squared norms are summed per tuple of process groups to reduce over (the key is
    the groups' names, the same for every parameter of one layout), then each distinct
    group is all-reduced once, in order of first appearance (the same on every rank:
    every rank iterates the same parameters)."""
    shards: dict[tuple[str, ...], list[torch.Tensor]] = {}
    groups: dict[tuple[str, ...], tuple[dist.ProcessGroup, ...]] = {}
    whole: list[torch.Tensor] = []  # squared norms already summed over their mesh
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        over = _split_over(g) if isinstance(g, DTensor) else ()
        if over is None:
            whole.append(g.norm().full_tensor().float().square())
            continue
        key = tuple(pg.group_name for pg in over)
        shards.setdefault(key, []).append(_local(g))
        groups.setdefault(key, over)
    if not shards and not whole:
        return torch.zeros(())
    device = next(iter(shards.values()))[0].device if shards else whole[0].device

    keys = list(shards)
    sums = [torch.stack(torch._foreach_norm(shards[k], 2, dtype=torch.float32)).to(device).square().sum()
            for k in keys]
    order: dict[str, dist.ProcessGroup] = {}
    for k in keys:
        for name, pg in zip(k, groups[k]):
            order.setdefault(name, pg)
    for name, pg in order.items():
        idx = [i for i, k in enumerate(keys) if name in k]
        buf = torch.stack([sums[i] for i in idx])
        dist.all_reduce(buf, group=pg)
        for j, i in enumerate(idx):
            sums[i] = buf[j]
    total = torch.stack(sums + [w.to(device) for w in whole]).sum()
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
