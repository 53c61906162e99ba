"""Balanced sequence packing: which sequences go to which rank and micro-batch, and
how a micro-batch becomes one packed row.

Two steps, each a plain greedy:
1. ranks: sequences sorted longest first, each to the data-parallel rank with the fewest
   tokens so far (LPT). Rank totals then differ by at most the longest sequence.
2. micro-batches: on each rank, first-fit-decreasing into bins of
   `max_tokens_per_micro_batch` tokens.
Every rank gets the same number of micro-batches (short ranks get empty ones at the end),
because FSDP's collectives need all ranks to run the same number of forward/backward
passes; the caller runs a dummy (zero-weight) pass for an empty micro-batch.

A packed micro-batch is ONE row `[1, L]`: the documents end to end, position ids
restarting at 0 for each document. Attention must not cross documents: Hugging Face
models detect this from the restarting position ids when `attention_mask` is None AND
there is no KV cache (sdpa / eager / flex then build a per-document causal mask), so call
`model(input_ids=..., position_ids=..., use_cache=False)`; without `use_cache=False` the
documents silently attend to each other. The context-parallel attention
(`rlhf_trainer.parallel.context_parallel`) instead takes `document_ids` explicitly.

Simplifications: no reordering across steps (the balance is per call), no cost model
beyond token counts (attention's quadratic term is ignored), and the greedy is not
optimal (LPT is within 4/3 of the best makespan; FFD within 11/9 of the fewest bins).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def balanced_micro_batches(
    lengths: Sequence[int], max_tokens_per_micro_batch: int, num_ranks: int
) -> list[list[list[int]]]:
    """Split sequences over `num_ranks` ranks and into micro-batches of at most
    `max_tokens_per_micro_batch` tokens.

    Returns `out[rank][micro_batch]` = list of indices into `lengths`. Every index occurs
    exactly once; every rank has the same number of micro-batches (trailing ones may be
    empty); rank token totals differ by at most `max(lengths)`.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks ({num_ranks}) must be at least 1")
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch ({max_tokens_per_micro_batch}) must be at least 1")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens_per_micro_batch]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"sequence {i} has {n} tokens, more than max_tokens_per_micro_batch "
            f"({max_tokens_per_micro_batch}); raise the budget or cap the sequence length"
        )
    # Longest first; ties by index so the result is deterministic.
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for i in order:
        r = min(range(num_ranks), key=lambda k: (load[k], k))
        per_rank[r].append(i)
        load[r] += lengths[i]

    out: list[list[list[int]]] = []
    for indices in per_rank:  # already longest first: first-fit-decreasing
        bins: list[list[int]] = []
        free: list[int] = []
        for i in indices:
            for b, room in enumerate(free):
                if lengths[i] <= room:
                    bins[b].append(i)
                    free[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                free.append(max_tokens_per_micro_batch - lengths[i])
        out.append(bins)
    num_micro = max((len(b) for b in out), default=0)
    for bins in out:
        bins.extend([] for _ in range(num_micro - len(bins)))
    return out


@dataclass
class Packed:
    """One packed row. Padding (if any) is one extra trailing document."""

    input_ids: torch.Tensor
    """[1, L] token ids, documents end to end."""
    position_ids: torch.Tensor
    """[1, L] position within each document (restarts at 0)."""
    document_ids: torch.Tensor
    """[1, L] index of the document each token belongs to (padding: len(sequences))."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 start offsets of the n real documents, then their end (flash-attn style)."""
    num_padding: int
    """Padding tokens at the end of the row."""


def pack(sequences: Sequence[Sequence[int]], *, pad_to_multiple_of: int = 1, pad_id: int = 0) -> Packed:
    """Concatenate `sequences` into one row; pad the end to a multiple of
    `pad_to_multiple_of` (e.g. the context-parallel size)."""
    lengths = [len(s) for s in sequences]
    total = sum(lengths)
    padded = -(-total // pad_to_multiple_of) * pad_to_multiple_of if total else pad_to_multiple_of
    num_padding = padded - total
    ids = [t for s in sequences for t in s] + [pad_id] * num_padding
    pos = [p for n in lengths for p in range(n)] + list(range(num_padding))
    doc = [d for d, n in enumerate(lengths) for _ in range(n)] + [len(lengths)] * num_padding
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return Packed(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        document_ids=torch.tensor([doc], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        num_padding=num_padding,
    )


def padding_fraction(
    micro_batches: Sequence[Sequence[int]], *, packed: bool, pad_to_multiple_of: int = 1
) -> float:
    """Fraction of the computed token slots that are padding.

    `micro_batches` holds the sequence LENGTHS of each micro-batch. Packed: a micro-batch
    costs its total rounded up to `pad_to_multiple_of`. Padded (the usual `[b, T]` batch):
    it costs `b x` its longest sequence. Empty micro-batches cost nothing.
    """
    real = computed = 0
    for mb in micro_batches:
        if not mb:
            continue
        n = sum(mb)
        real += n
        computed += -(-n // pad_to_multiple_of) * pad_to_multiple_of if packed else len(mb) * max(mb)
    return 0.0 if computed == 0 else (computed - real) / computed
