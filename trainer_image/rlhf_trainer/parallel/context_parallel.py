"""Attention over packed rows, plain and context parallel (Llama-3 style all-gather CP),
for Hugging Face decoder models: one kernel call per layer, no dense mask.

Each CP rank holds one contiguous slice of a packed row (`shard_sequence`). Everything
but attention is per token, so only attention needs the other slices: in every layer
the rank all-gathers the keys and values of the whole row and attends its local queries
to them. Position ids are the global per-document positions of the packed row (sliced,
not recomputed), so RoPE is unchanged.

Which query sees which key is given by the documents' boundaries, as segments built once
per micro-batch (`AttentionSegments`, from `cp_inputs`): for every document with queries
on this rank, its local query rows and the key columns from the document's start to its
last local query. Query i of a segment sees its keys up to its own position: causal
aligned to the bottom right, as flash attention's varlen kernel defines it for
segments with more keys than queries (the rank's first document when it began on an
earlier rank). So
- on CUDA in bf16 / fp16, ONE `torch.nn.attention.varlen.varlen_attn` call per layer
  takes the whole micro-batch (flash attention over the segments' cumulative offsets,
  grouped-query attention native: K and V never repeated). Its keywords are feature-detected
  (`varlen_arguments`): an older torch without `enable_gqa` gets K and V repeated, one
  without `scale` a pre-scaled query, one without `varlen_attn` the per-segment path below;
- elsewhere (CPU, fp32) one `scaled_dot_product_attention` per segment: `is_causal`
  where queries and keys coincide, a lower-right triangular mask of that segment alone
  for a rank's first document; no [L/cp, L] mask is ever built (the CPU flash kernel has no varlen form and
  FlexAttention has no CPU backward in torch 2.14).

The attention function is registered in transformers' attention registry under
`CP_ATTENTION` and selected with `model.set_attn_implementation`; HF then builds no mask
of its own. The model is called with the extra keywords of `cp_inputs` (the whole row's
`document_ids` and boundaries, and this rank's segments), which transformers passes
through to the attention function:

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
fine up to ~100k tokens for small KV-head counts; ring attention would avoid this), no
load balancing of the causal work (the last rank does the most attention FLOPs), batch
size 1 (one packed row), no dropout, no sliding-window layers.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class AttentionSegments:
    """This rank's attention work on one packed row: for each document with queries here,
    (first query row, end query row) in local coordinates and (first key, end key) in
    whole-row coordinates; the query rows of all segments tile the local slice. `cu_q` /
    `cu_k` are the same as cumulative int32 offsets (keys counted from `segments[0]`'s
    first key), as `varlen_attn` takes them."""

    q_start: int
    segments: tuple[tuple[int, int, int, int], ...]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @classmethod
    def build(cls, bounds: tuple[int, ...], q_start: int, q_len: int) -> "AttentionSegments":
        """From the row's document boundaries (cumulative offsets ending at the row's
        length) for the queries `q_start ... q_start + q_len - 1`."""
        q_end, segments = q_start + q_len, []
        for doc_start, doc_end in zip(bounds[:-1], bounds[1:]):
            lo, hi = max(doc_start, q_start), min(doc_end, q_end)
            if hi > lo:
                segments.append((lo - q_start, hi - q_start, doc_start, hi))
        if sum(hi - lo for lo, hi, _, _ in segments) != q_len:
            raise ValueError(f"document bounds {bounds[:4]}... do not cover queries {q_start}..{q_end - 1}")
        q_lens = [hi - lo for lo, hi, _, _ in segments]
        k_lens = [k_hi - k_lo for _, _, k_lo, k_hi in segments]
        offsets = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)  # noqa: E731
        return cls(q_start, tuple(segments), offsets(q_lens), offsets(k_lens), max(q_lens), max(k_lens))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "AttentionSegments":
        return replace(self, cu_q=self.cu_q.to(device, non_blocking=non_blocking),
                       cu_k=self.cu_k.to(device, non_blocking=non_blocking))


def uses_varlen(query: torch.Tensor) -> bool:
    """Flash attention's varlen kernel: CUDA, half precision."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


@functools.cache
def varlen_features() -> frozenset[str] | None:
    """The keyword arguments this torch's `varlen_attn` takes (None: it has none). Its
    keywords grew release by release (torch 2.10: `is_causal`; later `window_size`,
    `scale`, `enable_gqa`), and the trainer image's torch may be older than our pin."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_arguments(features: frozenset[str], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None, gqa: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """query [T, Hq, D], key / value [T, Hkv, D] and the keywords for a `varlen_attn` taking
    `features`, bottom-right causal: without `enable_gqa` K and V are repeated per query
    head (query head h reads KV head h // (Hq / Hkv), as grouped-query attention does);
    without `scale` the query is pre-scaled so the kernel's default 1/sqrt(D) gives it."""
    kwargs: dict = {"window_size": (-1, 0)} if "window_size" in features else {"is_causal": True}
    if gqa and "enable_gqa" in features:
        kwargs["enable_gqa"] = True
    elif gqa:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if scaling is not None and "scale" in features:
        kwargs["scale"] = scaling
    elif scaling is not None:
        query = query * (scaling * math.sqrt(query.shape[-1]))
    return query, key, value, kwargs


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seg: AttentionSegments,
                      scaling: float | None, gqa: bool) -> torch.Tensor:
    """query [1, Hq, S, D] (this rank's slice), key / value [1, Hkv, L, D] (the whole row)
    -> [1, S, Hq, D], each query attending to its document's keys up to its own position."""
    first_key, last_key = seg.segments[0][2], seg.segments[-1][3]
    features = varlen_features() if uses_varlen(query) else None
    if features is not None and ({"window_size", "is_causal"} & features):
        from torch.nn.attention.varlen import varlen_attn

        q, k, v, kwargs = varlen_arguments(features, query[0].transpose(0, 1),
                                           key[0, :, first_key:last_key].transpose(0, 1),
                                           value[0, :, first_key:last_key].transpose(0, 1), scaling, gqa)
        out = varlen_attn(q, k, v, seg.cu_q.to(query.device), seg.cu_k.to(query.device), seg.max_q, seg.max_k,
                          **kwargs)
        return out.unsqueeze(0)
    parts = []
    for q_lo, q_hi, k_lo, k_hi in seg.segments:
        q, k, v = query[:, :, q_lo:q_hi], key[:, :, k_lo:k_hi], value[:, :, k_lo:k_hi]
        if q_hi - q_lo == k_hi - k_lo:
            parts.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa))
        else:  # the rank's first document began on an earlier rank: causal to the bottom right
            visible = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool, device=q.device).tril(
                diagonal=(k_hi - k_lo) - (q_hi - q_lo))
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling, enable_gqa=gqa))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2).contiguous()


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
    attention_segments: AttentionSegments | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with the signature of transformers' registry.

    query [b, Hq, S, D], key / value [b, Hkv, S, D] are this rank's slice (S = L / cp);
    returns the output [b, S, Hq, D] as HF's attention functions do.
    """
    if dropout:
        raise ValueError("packed / context-parallel attention does not implement attention dropout")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    mesh: DeviceMesh | None = getattr(module, "cp_mesh", None)
    seq = query.shape[2]
    gqa = query.shape[1] != key.shape[1]
    q_start = 0
    if mesh is not None and mesh.size() > 1:
        # ONE collective for K and V together (see the module docstring).
        kv = all_gather_sequence(torch.stack([key, value]), mesh.get_group(), dim=3)
        key, value = kv.unbind(0)
        q_start = mesh.get_local_rank() * seq
    if attention_segments is None or attention_segments.q_start != q_start:
        if document_bounds is None:
            if document_ids is None:
                raise ValueError(
                    "packed attention needs the documents' boundaries (`document_bounds`, or the whole row's "
                    "`document_ids`) passed to the model's forward; see cp_inputs()")
            document_bounds = bounds_of(document_ids)
        attention_segments = AttentionSegments.build(tuple(document_bounds), q_start, seq)
    if attention_segments.segments[-1][3] > key.shape[2]:
        raise ValueError(f"the documents cover {attention_segments.segments[-1][3]} tokens but the keys "
                         f"{key.shape[2]}; pass the whole row's boundaries")
    return segment_attention(query, key, value, attention_segments, scaling, gqa), None


def bounds_of(document_ids: torch.Tensor) -> tuple[int, ...]:
    """Cumulative document boundaries of a packed row from its [1, L] / [L] document ids."""
    ids = document_ids.reshape(-1)
    change = (torch.nonzero(ids[1:] != ids[:-1]).reshape(-1) + 1).tolist()
    return (0, *change, ids.numel())


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
    local slices of `input_ids` / `position_ids`, the whole row's `document_ids` and
    boundaries, and this rank's attention segments (built once per micro-batch, shared by
    every layer and by recomputation)."""
    bounds = [int(x) for x in packed.cu_seqlens.tolist()]
    total = packed.input_ids.shape[-1]
    if bounds[-1] < total:  # trailing padding: its own document
        bounds.append(total)
    cp = 1 if cp_mesh is None else cp_mesh.size()
    rank = 0 if cp == 1 else cp_mesh.get_local_rank()
    input_ids = shard_sequence(packed.input_ids, cp_mesh)
    seq = input_ids.shape[-1]
    return {
        "input_ids": input_ids,
        "position_ids": shard_sequence(packed.position_ids, cp_mesh),
        "document_ids": packed.document_ids,
        "document_bounds": tuple(bounds),
        "attention_segments": AttentionSegments.build(tuple(bounds), rank * seq, seq),
    }
