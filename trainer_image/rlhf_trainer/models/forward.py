"""Forward passes over packed micro-batches (data/micro_batches.py), for any data x
context x tensor layout: the policy's per-token log-probs and entropy (through the
chunked head of models/logprob_head.py), the critic's values, a score model's scores at
each sequence's last token.

With context parallelism each rank holds a contiguous slice of the packed row: inputs
and per-token tensors are sliced with `shard_sequence`, and no-grad results are
all-gathered back to whole rows (`whole_row`). Attention takes the documents' explicit
boundaries (parallel/context_parallel.py): documents never attend to each other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..data.balanced_packing import Packed
from ..data.micro_batches import MicroBatch
from ..parallel.context_parallel import AttentionSegments, cp_inputs, shard_sequence
from .logprob_head import chunked_token_stats, has_logprob_head, request_stats, token_stats


def next_token_targets(packed: Packed) -> torch.Tensor:
    """[1, L]: the next token of each position (0 after a document's end: never weighted)."""
    ids = packed.input_ids
    return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)


def local(x: torch.Tensor, cp_mesh: DeviceMesh | None, device: torch.device) -> torch.Tensor:
    """This rank's slice of a whole-row [1, L] tensor."""
    return shard_sequence(x, cp_mesh).to(device, non_blocking=True)


def model_inputs(mb: MicroBatch, cp_mesh: DeviceMesh | None, device: torch.device) -> dict:
    """The keyword arguments of a decoder's forward for this rank's slice of `mb`."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, (torch.Tensor, AttentionSegments)) else v
            for k, v in cp_inputs(mb.packed, cp_mesh).items()}


def predicting_positions(mb: MicroBatch, cp_mesh: DeviceMesh | None, device: torch.device) -> torch.Tensor:
    """The local rows of this rank's slice that predict a response token (the only rows
    whose log-probs anything reads), as a LongTensor."""
    rows = [p for k in range(len(mb.rows)) for p in mb.positions(k)]
    if cp_mesh is not None and cp_mesh.size() > 1:
        size = mb.length // cp_mesh.size()
        start = cp_mesh.get_local_rank() * size
        rows = [p - start for p in rows if start <= p < start + size]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def policy_forward(model: torch.nn.Module, mb: MicroBatch, cp_mesh: DeviceMesh | None, device: torch.device,
                   temperature: float = 1.0, entropy: str = "grad") -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of the next token [1, l], entropy [1, l]) on this rank's slice, both at
    `temperature` (logits divided by it, as the sampler did), at the predicting positions
    of response tokens (zeros elsewhere). `entropy`: "grad" when a loss term uses it,
    "value" for the metric only, "none" when nothing reads it (models/logprob_head.py)."""
    positions = predicting_positions(mb, cp_mesh, device)
    targets = local(next_token_targets(mb.packed), cp_mesh, device)[0, positions]
    if not has_logprob_head(model):
        logits = model(**model_inputs(mb, cp_mesh, device), use_cache=False).logits
        picked = chunked_token_stats(token_stats, logits[:, positions], (), targets, temperature,
                                     entropy=entropy).reshape(1, -1, 2)
        stats = picked.new_zeros(1, logits.shape[1], 2).index_copy(1, positions, picked)
    else:
        request_stats(model, targets, temperature, positions, entropy)
        try:
            stats = model(**model_inputs(mb, cp_mesh, device), use_cache=False).logits
        finally:
            request_stats(model, None)
    return stats[..., 0], stats[..., 1]


def critic_forward(critic: torch.nn.Module, mb: MicroBatch, cp_mesh: DeviceMesh | None,
                   device: torch.device) -> torch.Tensor:
    """Values [1, l] on this rank's slice."""
    return critic(**model_inputs(mb, cp_mesh, device)).float()


def whole_row(x: torch.Tensor, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """All-gather a [1, l] slice back into the whole [1, L] row (no gradient)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x.detach()
    parts = [torch.empty_like(x) for _ in range(cp_mesh.size())]
    dist.all_gather(parts, x.detach().contiguous(), group=cp_mesh.get_group())
    return torch.cat(parts, dim=1)


def last_token_scores(model: torch.nn.Module, mb: MicroBatch, cp_mesh: DeviceMesh | None,
                      device: torch.device, *, whole: bool = False) -> torch.Tensor:
    """[n] scores of a score model (one scalar per position) at the last token of each of
    `mb`'s sequences. `whole`: all-gather the context-parallel slices first (no gradient)."""
    scores = model(**model_inputs(mb, cp_mesh, device))
    if whole:
        scores = whole_row(scores, cp_mesh)
    return scores[0][torch.tensor(mb.last_positions(), dtype=torch.long, device=scores.device)]
