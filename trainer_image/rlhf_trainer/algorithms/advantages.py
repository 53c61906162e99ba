"""Advantage estimators.

Shapes: B sequences x T response tokens; `mask` [B, T] is 1 on response tokens.
`token_rewards` [B, T] holds the outcome reward on the last response token plus any
per-token KL penalty (KL in the reward). For the outcome estimators r = row sum of
`token_rewards` over the mask, and the scalar advantage of a row is broadcast to its valid
tokens (0 on masked-out tokens). Groups are consecutive blocks of `group_size` rows (the
samples of one prompt).

  gae       (Schulman et al. 2016, PPO):  delta_t = r_t + gamma V_{t+1} - V_t,
            A_t = delta_t + gamma lam A_{t+1}; the last valid token is terminal
            (V after it is 0). Optional whitening with norm_std=True.
  grpo      (Shao et al. 2024, DeepSeekMath):  A = (r - mean_g r) / (std_g r + 1e-6),
            std unbiased (Bessel); norm_std=False gives dr_grpo.
  dr_grpo   (Liu et al. 2025, Dr. GRPO):  A = r - mean_g r
  rloo      (Ahmadian et al. 2024):  A_i = r_i - mean_{j != i} r_j
  reinforce_pp (Hu 2025, REINFORCE++):  G_t = sum_{k >= t} gamma^(k-t) r_k (discounted
            return of the token rewards), whitened over the batch's valid tokens.
  reinforce_pp_baseline:  A = r - mean_g r broadcast to the tokens, then whitened over
            the batch's valid tokens.
Whitening: (x - mean) / (std + 1e-8) over valid tokens, std unbiased.

Departure: a group of one sample has std 0 for grpo, so its advantage is 0 (not NaN).
"""

from __future__ import annotations

import torch

from rlhf_contract.api.models import ESTIMATORS
from rlhf_contract.api.rules import GROUP_ESTIMATORS

WHITEN_EPS = 1e-8


def outcome_rewards(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r [B]: the row sums of `token_rewards` over valid tokens."""
    return (token_rewards * mask).sum(dim=-1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the whole batch; 0 where masked."""
    n = mask.sum()
    if n < 1:
        return torch.zeros_like(x)
    mean = (x * mask).sum() / n
    var = ((x - mean).square() * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * mask


def _group_centered(r: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"batch of {r.shape[0]} rows is not a whole number of groups of {group_size}")
    grouped = r.view(-1, group_size)
    return grouped, grouped - grouped.mean(dim=-1, keepdim=True)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over valid tokens [B, T]."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] * mask[:, t] + gamma * running * mask[:, t]
        out[:, t] = running
    return out * mask


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] by GAE; the value after the last valid token is 0."""
    b, t_len = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    next_value = torch.zeros(b, dtype=values.dtype, device=values.device)
    running = torch.zeros(b, dtype=values.dtype, device=values.device)
    for t in reversed(range(t_len)):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        adv[:, t] = running
        # a masked position passes nothing back: the next valid token sees V = 0, A = 0
        next_value = values[:, t] * m
    return adv, (adv + values) * mask


def compute_advantages(
    estimator: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    group_size: int = 1,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_std: bool | None = None,
) -> torch.Tensor:
    """Advantages [B, T] for `estimator` (see the module docstring)."""
    mask = mask.to(token_rewards.dtype)
    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs values from a critic (algorithm.critic)")
        adv, _ = gae(token_rewards, values, mask, gamma, lam)
        return masked_whiten(adv, mask) if norm_std else adv
    if estimator == "reinforce_pp":
        return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)
    if estimator not in ESTIMATORS:
        raise ValueError(f"algorithm.advantageEstimator: {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    r = outcome_rewards(token_rewards, mask)
    grouped, centered = _group_centered(r, group_size)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        adv = centered * group_size / (group_size - 1)
    elif estimator == "reinforce_pp_baseline":
        return masked_whiten(centered.reshape(-1, 1) * mask, mask)
    else:
        adv = centered
        if norm_std if norm_std is not None else estimator == "grpo":
            std = grouped.std(dim=-1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(adv)
            adv = adv / (std + 1e-6)
    return adv.reshape(-1, 1) * mask


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025) per response [B]:
    0 up to max_len - cache_len, then linear down to -1 at max_len, -1 beyond."""
    expected = max_len - cache_len
    if cache_len <= 0:
        return torch.where(lengths > max_len, -1.0, 0.0).to(torch.float32)
    pen = (expected - lengths.to(torch.float32)) / cache_len
    return pen.clamp(min=-1.0, max=0.0)


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: a bool per group [B / group_size], False where every
    sample of the group got the same reward (no learning signal)."""
    grouped = rewards.view(-1, group_size)
    return (grouped.max(dim=-1).values - grouped.min(dim=-1).values) > 0
