"""What crosses the orchestrator -> trainer boundary: a step's sampled sequences (`Row`)
in one `RolloutBatch`, and their per-token tables.

Per-token tables of a step are [B, T]: row i's response tokens in columns 0..len-1,
zeros after (the forward passes themselves are packed: see train/micro_batches.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    """One sampled sequence."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    score: float
    truncated: bool
    loss_mask: list[int] | None = None
    """1 on tokens to train on; None means every response token (single turn). Multi-turn
    rows hold environment tokens with 0."""

    def mask(self) -> list[float]:
        return [float(m) for m in self.loss_mask] if self.loss_mask is not None else [1.0] * len(self.response_ids)


def pad_rows(values: list[list[float]], width: int) -> torch.Tensor:
    """Right-pad per-row lists to [len(values), width] with zeros."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, v in enumerate(values):
        if v:
            out[i, :len(v)] = torch.tensor(v[:width], dtype=torch.float32)
    return out


@dataclass
class RolloutStats:
    """Rank 0's statistics of one step's rollout (logged as they are)."""

    reward_mean: float
    score_mean: float
    response_length_mean: float
    truncated_fraction: float
    dropped_group_fraction: float
    num_tokens: int
    """Prompt + response tokens of the step."""
    dropped_prompts: int = 0
    """Prompts skipped by the data source so far (too long or empty)."""


@dataclass
class RolloutBatch:
    """One step's groups, flattened: rows `g * group_size .. (g + 1) * group_size - 1`
    are the samples of prompt g."""

    rows: list[Row]
    group_size: int
    stats: RolloutStats
    extra: dict = field(default_factory=dict)
