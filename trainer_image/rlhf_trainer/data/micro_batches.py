"""Micro-batches of a step's sequences, for any data x context layout.

Each sequence is prompt + response. `plan()` balances the sequences over the
data-parallel ranks and packs each rank's share into micro-batches of at most
`trainer.maxTokensPerMicroBatch` tokens (`data/balanced_packing.py`): no padding, and
documents never attend to each other. A unit of planning is one row or a group of rows
kept together (a preference pair's chosen and rejected sequences).

Per-token quantities live at the "predicting" positions: response token j of a sequence
that starts at offset s with a prompt of P tokens is predicted by packed position
s + P - 1 + j, where the log-prob of the next token and the critic's value V(state before
token j) sit. `scatter` puts per-sequence values there, `gather` reads them back; a
sequence's score (reward model) sits at its last token (`last_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .balanced_packing import Packed, balanced_micro_batches, pack
from .sequences import Row


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

    def last_positions(self) -> list[int]:
        """The packed position of each sequence's last token."""
        return [self.starts[k] + self.prompt_lengths[k] + self.response_lengths[k] - 1 for k in range(len(self.rows))]

    def scatter(self, values: list[list[float]] | list[torch.Tensor]) -> torch.Tensor:
        """Per-sequence values (aligned with response tokens) -> [1, L] at predicting positions."""
        out = torch.zeros(1, self.length, dtype=torch.float32)
        for k, v in enumerate(values):
            pos = self.positions(k)
            if len(pos):
                out[0, pos.start:pos.stop] = torch.as_tensor(v, dtype=torch.float32)[:len(pos)]
        return out

    def gather(self, row: torch.Tensor) -> list[torch.Tensor]:
        """[1, L] whole-row tensor -> per-sequence tensors (on the CPU) at predicting positions."""
        flat = row[0].detach().float().cpu()
        return [flat[p.start:p.stop] for p in (self.positions(k) for k in range(len(self.rows)))]


def plan(rows: list[Row], units: Sequence[int | Sequence[int]], budget: int, dp_size: int,
         cp_size: int = 1) -> list[list[MicroBatch]]:
    """Micro-batches of `units` for every data-parallel rank (same count on each rank).
    A unit is a row index or a sequence of row indices packed next to each other in one
    micro-batch."""
    groups = [[u] if isinstance(u, int) else list(u) for u in units]
    lengths = [sum(len(rows[i].prompt_ids) + len(rows[i].response_ids) for i in g) for g in groups]
    out = []
    for rank_batches in balanced_micro_batches(lengths, budget, dp_size):
        micro = []
        for mb in rank_batches:
            chosen = [i for j in mb for i in groups[j]]
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
