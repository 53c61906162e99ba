"""Packed forward passes over a step's sequences, for any data x context x tensor layout.

Each sequence is prompt + response. `plan()` balances the sequences over the
data-parallel ranks and packs each rank's share into micro-batches of at most
`trainer.maxTokensPerMicroBatch` tokens (data/packing.py): no padding, and documents never
attend to each other. Per-token quantities live at the "predicting" positions: response
token j of a sequence that starts at offset s with a prompt of P tokens is predicted by
packed position s + P - 1 + j, where the logits, the log-prob of the next token and the
critic's value V(state before token j) all sit. `scatter` puts per-sequence lists there,
`gather` reads them back. With context parallelism each rank holds a contiguous slice of
the packed row: inputs and per-token tensors are sliced with `shard_sequence`, and
no-grad results are all-gathered back to whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .batch import Row
from .data.packing import Packed, balanced_micro_batches, pack
from .parallel.context_parallel import cp_inputs, shard_sequence


@dataclass
class MicroBatch:
    """One packed forward pass: `rows` are indices into the step's rows."""

    rows: list[int]
    packed: Packed
    starts: list[int]
    prompt_lengths: list[int]
    response_lengths: list[int]

    @property
    def length(self) -> int:
        return self.packed.input_ids.shape[1]

    def positions(self, k: int) -> range:
        start = self.starts[k] + self.prompt_lengths[k] - 1
        return range(start, start + self.response_lengths[k])

    def scatter(self, values: list[list[float]] | list[torch.Tensor]) -> torch.Tensor:
        """Per-sequence values (aligned with response tokens) -> [1, L] at predicting positions."""
        out = torch.zeros(1, self.length, dtype=torch.float32)
        for k, v in enumerate(values):
            pos = self.positions(k)
            if len(pos):
                out[0, pos.start:pos.stop] = torch.as_tensor(v, dtype=torch.float32)[:len(pos)]
        return out

    def gather(self, row: torch.Tensor) -> list[list[float]]:
        """[1, L] whole-row tensor -> per-sequence lists at predicting positions."""
        flat = row[0].detach().float().cpu()
        return [flat[p.start:p.stop].tolist() for p in (self.positions(k) for k in range(len(self.rows)))]


def plan(rows: list[Row], indices: list[int], budget: int, dp_size: int, cp_size: int) -> list[list[MicroBatch]]:
    """Micro-batches of `indices` for every data-parallel rank (same count on each rank)."""
    lengths = [len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in indices]
    out = []
    for rank_batches in balanced_micro_batches(lengths, budget, dp_size):
        micro = []
        for mb in rank_batches:
            chosen = [indices[j] for j in mb]
            seqs = [rows[i].prompt_ids + rows[i].response_ids for i in chosen]
            starts, offset = [], 0
            for s in seqs:
                starts.append(offset)
                offset += len(s)
            micro.append(MicroBatch(chosen, pack(seqs, pad_to_multiple_of=cp_size), starts,
                                    [len(rows[i].prompt_ids) for i in chosen],
                                    [len(rows[i].response_ids) for i in chosen]))
        out.append(micro)
    return out


def next_token_targets(packed: Packed) -> torch.Tensor:
    """[1, L]: the next token of each position (0 after a document's end: never weighted)."""
    ids = packed.input_ids
    return torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)


def _model_inputs(mb: MicroBatch, cp_mesh: DeviceMesh | None, device: torch.device) -> dict[str, torch.Tensor]:
    if cp_mesh is not None:
        inputs = cp_inputs(mb.packed, cp_mesh)
    else:  # Hugging Face builds the per-document mask from the restarting position ids
        inputs = {"input_ids": mb.packed.input_ids, "position_ids": mb.packed.position_ids}
    return {k: v.to(device) for k, v in inputs.items()}


def local(x: torch.Tensor, cp_mesh: DeviceMesh | None, device: torch.device) -> torch.Tensor:
    """This rank's slice of a whole-row [1, L] tensor."""
    return shard_sequence(x, cp_mesh).to(device)


def policy_forward(model: torch.nn.Module, mb: MicroBatch, cp_mesh: DeviceMesh | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [1, l, V], log-prob of the next token [1, l]) on this rank's slice."""
    logits = model(**_model_inputs(mb, cp_mesh, device), use_cache=False).logits.float()
    targets = local(next_token_targets(mb.packed), cp_mesh, device)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logits, logp


def critic_forward(critic: torch.nn.Module, mb: MicroBatch, cp_mesh: DeviceMesh | None,
                   device: torch.device) -> torch.Tensor:
    """Values [1, l] on this rank's slice."""
    return critic(**_model_inputs(mb, cp_mesh, device)).float()


def whole_row(x: torch.Tensor, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """All-gather a [1, l] slice back into the whole [1, L] row (no gradient)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x.detach()
    parts = [torch.empty_like(x) for _ in range(cp_mesh.size())]
    dist.all_gather(parts, x.detach().contiguous(), group=cp_mesh.get_group())
    return torch.cat(parts, dim=1)
