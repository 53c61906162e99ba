"""Outcome advantage estimators for groups of samples of the same prompt.

Shapes: B sequences x T response tokens; `mask` [B, T] is 1 on response tokens.
`token_rewards` [B, T] holds the outcome reward on the last response token (plus any
per-token KL penalty); r = row sum of token_rewards over the mask. Groups are consecutive
blocks of `group_size` rows. The scalar advantage of a row is broadcast to its valid tokens
(0 on masked-out tokens).

  grpo    (Shao et al. 2024, DeepSeekMath):  A = (r - mean_g r) / (std_g r + 1e-6),
          std unbiased (Bessel); `norm_std=False` turns it into dr_grpo.
  dr_grpo (Liu et al. 2025, "Understanding R1-Zero-like training"):  A = r - mean_g r
  rloo    (Ahmadian et al. 2024):  A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r)

Not here yet: gae, reinforce_pp, reinforce_pp_baseline (the full algorithm table is a
later step).
"""

from __future__ import annotations

import torch

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def outcome_rewards(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r [B]: the row sums of `token_rewards` over valid tokens."""
    return (token_rewards * mask).sum(dim=-1)


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
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"algorithm.advantageEstimator: {estimator!r} is not one of {', '.join(GROUP_ESTIMATORS)}")
    mask = mask.to(token_rewards.dtype)
    r = outcome_rewards(token_rewards, mask)
    num_rows = r.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"batch of {num_rows} rows is not a whole number of groups of {group_size}")
    grouped = r.view(-1, group_size)
    mean = grouped.mean(dim=-1, keepdim=True)
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs at least 2 samples per prompt")
        adv = (grouped - mean) * group_size / (group_size - 1)
    else:
        adv = grouped - mean
        if norm_std if norm_std is not None else estimator == "grpo":
            std = grouped.std(dim=-1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(mean)
            adv = adv / (std + 1e-6)
    return adv.reshape(num_rows, 1) * mask
