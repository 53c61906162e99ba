"""Context parallelism (Llama-3 style all-gather CP) for Hugging Face decoder models.

Each CP rank holds one contiguous slice of a packed row (`shard_sequence`). Everything
but attention is per token, so only attention needs the other slices: in every layer
the rank all-gathers the keys and values of the whole row and attends its local queries
to them with an explicit mask = causal AND same document. Position ids are the global
per-document positions of the packed row (sliced, not recomputed), so RoPE is unchanged.

The attention function is registered in transformers' attention registry under
`CP_ATTENTION` and selected with `model.set_attn_implementation`; HF then builds no
mask of its own. The model is called with one extra keyword, `document_ids` ([1, L] or
[L], the WHOLE row's ids, e.g. `Packed.document_ids`), which transformers passes through
to the attention function:

    batch = cp_inputs(packed, cp_mesh)
    logits = model(**batch, use_cache=False).logits  # local slice of the logits

K and V go through ONE stacked autograd all-gather per layer. (Two separate autograd
all-gathers gave wrong dK/dV on gloo: their backward collectives can run in different
orders on different ranks.) Backward reduce-scatters the gathered gradient (on CPU,
i.e. gloo, which has no reduce-scatter: all-reduce, then keep this rank's slice).

Targets that cross a slice boundary (the next token of a slice's last token lives on the
next rank) must be computed on the whole row before sharding; the loss is normalized by
the GLOBAL token count (the train step's aggregation weights), never the local one.

Simplifications: the whole K/V row is materialized on every rank (memory O(L) per rank,
fine up to ~100k tokens for small KV-head counts; ring attention would avoid this), the
mask is dense [L/cp, L] (no flash / flex kernel, no load balancing of the causal work:
the last rank does the most attention FLOPs), batch size 1 (one packed row), no
dropout in CP attention, no sliding-window layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .layers import decoder_layers

CP_ATTENTION = "rlhf_context_parallel"
"""Name of the CP attention function in transformers' `AttentionInterface` registry."""


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along `dim` (forward); sum the gradients and keep this rank's slice
    (backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = [c.contiguous() for c in grad.chunk(world, dim=dim)]
        if grad.device.type == "cpu":  # gloo: no reduce_scatter
            full = torch.cat(chunks, dim=dim)
            dist.all_reduce(full, group=group)
            return full.chunk(world, dim=dim)[rank].contiguous(), None, None
        out = torch.empty_like(chunks[rank])
        dist.reduce_scatter(out, chunks, group=group)
        return out, None, None


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Autograd all-gather of `x` along `dim` over `group` (rank order)."""
    return _AllGatherSeq.apply(x, group, dim)


def document_causal_mask(document_ids: torch.Tensor, q_start: int, q_len: int) -> torch.Tensor:
    """Boolean mask [b, q_len, L] (True = attend) for queries `q_start..q_start+q_len` of a
    row with `document_ids` [b, L]: key j is visible to query i iff j <= i and both are in
    the same document."""
    q_pos = torch.arange(q_start, q_start + q_len, device=document_ids.device)
    k_pos = torch.arange(document_ids.shape[-1], device=document_ids.device)
    same_doc = document_ids[:, q_pos, None] == document_ids[:, None, :]
    return same_doc & (k_pos[None, None, :] <= q_pos[None, :, None])


def context_parallel_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    document_ids: torch.Tensor | None = None,
    document_bounds: tuple[int, ...] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with the signature of transformers' registry.

    query [b, Hq, S, D], key / value [b, Hkv, S, D] are this rank's slice (S = L / cp);
    returns the output [b, S, Hq, D] as HF's attention functions do.
    """
    if document_ids is None:
        raise ValueError(
            "context-parallel attention needs `document_ids` (the whole packed row's "
            "document ids) passed to the model's forward; see cp_inputs()"
        )
    if dropout:
        raise ValueError("context-parallel attention does not implement attention dropout")
    mesh: DeviceMesh | None = getattr(module, "cp_mesh", None)
    seq = query.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if (mesh is None or mesh.size() == 1) and document_bounds is not None:
        return packed_document_attention(query, key, value, document_bounds, scaling, gqa), None
    if mesh is not None and mesh.size() > 1:
        group = mesh.get_group()
        # ONE collective for K and V together (see the module docstring).
        kv = all_gather_sequence(torch.stack([key, value]), group, dim=3)
        key, value = kv.unbind(0)
        q_start = mesh.get_local_rank() * seq
    else:
        q_start = 0
    document_ids = document_ids.reshape(-1, document_ids.shape[-1]).to(query.device)
    if document_ids.shape[-1] != key.shape[2]:
        raise ValueError(
            f"document_ids cover {document_ids.shape[-1]} tokens but the gathered keys "
            f"{key.shape[2]}; pass the whole row's document ids"
        )
    mask = document_causal_mask(document_ids, q_start, seq)[:, None]  # [b, 1, S, L]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def packed_document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              bounds: tuple[int, ...], scaling: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention within each document of a packed row (no context parallelism):
    one `scaled_dot_product_attention(is_causal=True)` per document, from the explicit
    boundaries `bounds` (cumulative offsets, trailing padding as a last document), so no
    [L, L] mask is ever built and SDPA may pick its flash / memory-efficient kernel.
    Grouped-query attention is SDPA's own (`enable_gqa`): K and V are never repeated.
    Returns [b, L, Hq, D] like HF's attention functions."""
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            parts.append(F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                is_causal=True, scale=scaling, enable_gqa=gqa))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2).contiguous()


def apply_cp(model: torch.nn.Module, cp_mesh: DeviceMesh | None) -> torch.nn.Module:
    """Switch `model`'s attention to the context-parallel function over `cp_mesh`.

    With `cp_mesh=None` (or size 1) the same function is an explicit per-document causal
    attention over the whole row.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, context_parallel_attention)
    for layer in decoder_layers(model):
        layer.self_attn.cp_mesh = cp_mesh
    model.set_attn_implementation(CP_ATTENTION)
    return model


def shard_sequence(x: torch.Tensor, cp_mesh: DeviceMesh | None, dim: int = -1) -> torch.Tensor:
    """This CP rank's contiguous slice of `x` along `dim` (length must divide by cp)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    if x.shape[dim] % cp:
        raise ValueError(
            f"sequence length {x.shape[dim]} is not a multiple of the context parallel size "
            f"({cp}); pack with pad_to_multiple_of={cp}"
        )
    return x.chunk(cp, dim=dim)[rank]


def cp_inputs(packed, cp_mesh: DeviceMesh | None) -> dict:
    """Model keyword arguments for a `rlhf_trainer.data.balanced_packing.Packed` row: the
    local slices of `input_ids` / `position_ids`, the whole row's `document_ids` and (for
    the per-document kernel without context parallelism) the documents' boundaries."""
    bounds = [int(x) for x in packed.cu_seqlens.tolist()]
    total = packed.input_ids.shape[-1]
    if bounds[-1] < total:  # trailing padding: its own document
        bounds.append(total)
    return {
        "input_ids": shard_sequence(packed.input_ids, cp_mesh),
        "position_ids": shard_sequence(packed.position_ids, cp_mesh),
        "document_ids": packed.document_ids,
        "document_bounds": tuple(bounds),
    }
