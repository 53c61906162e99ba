"""A sampled or given sequence (`Row`): prompt and response token ids with what the
losses need of it. RL rows come from the rollout servers (orchestrator/), offline rows
from a dataset (offline/data.py); both are planned into packed micro-batches alike
(data/micro_batches.py).

Per-token tables of a step are [B, T]: row i's response tokens in columns 0..len-1,
zeros after (`pad_rows`); the forward passes themselves are packed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One sequence."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    score: float
    truncated: bool
    loss_mask: list[int] | None = None
    """1 on tokens to train on; None means every response token (single turn). Multi-turn
    rows hold environment tokens with 0."""
    components: dict[str, float] | None = None
    """Each reward function's own reward, by name, when `reward.components` is set."""
    extra: dict[str, Any] | None = None
    """What the reward functions logged for this response with TRL's `log_extra`, by column."""
    versions: list[int | None] | None = None
    """The policy version that sampled each response token (`rollout.inFlightUpdates`: one
    response may span a weight update); None when the server reports none."""

    def mask(self) -> list[float]:
        return [float(m) for m in self.loss_mask] if self.loss_mask is not None else [1.0] * len(self.response_ids)


def pad_rows(values: list[list[float]], width: int) -> torch.Tensor:
    """Right-pad per-row lists to [len(values), width] with zeros."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, v in enumerate(values):
        if v:
            out[i, :len(v)] = torch.tensor(v[:width], dtype=torch.float32)
    return out
