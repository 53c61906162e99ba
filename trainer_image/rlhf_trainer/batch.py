"""Batches of sampled sequences and the forward passes over them.

Prompts are left-padded to a common column P and responses right-padded after it, so
every response starts at column P and the logits / values that concern response token j
sit at column P - 1 + j for every row.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def pad_batch(rows: list[Row], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, position_ids [b, P + T], response_mask [b, T], start = P."""
    p_len = max(len(r.prompt_ids) for r in rows)
    t_len = max(max(len(r.response_ids) for r in rows), 1)
    b = len(rows)
    ids = torch.full((b, p_len + t_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p_len + t_len), dtype=torch.long)
    resp_mask = torch.zeros((b, t_len), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, t = len(r.prompt_ids), len(r.response_ids)
        ids[i, p_len - p:p_len] = torch.tensor(r.prompt_ids, dtype=torch.long)
        ids[i, p_len:p_len + t] = torch.tensor(r.response_ids, dtype=torch.long)
        attn[i, p_len - p:p_len + t] = 1
        if t:
            resp_mask[i, :t] = torch.tensor(r.mask())
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids.to(device), "attention_mask": attn.to(device), "position_ids": pos.to(device),
        "response_mask": resp_mask.to(device), "start": p_len,
    }


def _response_slice(x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    start, t_len = batch["start"], batch["response_mask"].shape[1]
    return x[:, start - 1:start - 1 + t_len]


def response_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits [b, T, V] that predict each response token."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], use_cache=False)
    return _response_slice(out.logits, batch).float()


def token_logprobs(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Log-probabilities [b, T] of the response tokens under `logits`."""
    start, t_len = batch["start"], batch["response_mask"].shape[1]
    targets = batch["input_ids"][:, start:start + t_len]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def response_values(critic: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Values [b, T]: V of the state before each response token."""
    values = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"])
    return _response_slice(values, batch).float()


def pad_rows(values: list[list[float]], width: int) -> torch.Tensor:
    """Right-pad per-row lists to [len(values), width] with zeros."""
    out = torch.zeros(len(values), width, dtype=torch.float32)
    for i, v in enumerate(values):
        if v:
            out[i, :len(v)] = torch.tensor(v[:width], dtype=torch.float32)
    return out
