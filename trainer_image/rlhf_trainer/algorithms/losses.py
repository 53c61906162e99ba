"""Policy loss (PPO clip with separate low/high clips and dual clip) and loss reduction.

Per token, with ratio = exp(logp - old_logp) and advantage A:
  l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))     (Schulman 2017;
      separate clip_high is DAPO's clip-higher, Yu et al. 2025)
  dual clip (Ye et al. 2020), where A < 0:  l = min(l, -A * c)
Reductions of a masked [B, T] loss (`agg`):
  token-mean               sum(l * m) / sum(m)
  seq-mean-token-mean      mean over rows of (row sum(l * m) / row sum(m))
  seq-mean-token-sum       mean over rows of row sum(l * m)
  seq-mean-token-sum-norm  mean over rows of (row sum(l * m) / T), T = mask.shape[-1] (Dr. GRPO)

Micro-batching: pass `num_tokens` / `num_seqs` (the totals of the whole step, across
processes) so that summing micro-batch losses gives the loss of the whole step.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def agg_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar (see the module docstring)."""
    mask = mask if mask.is_floating_point() else mask.to(loss.dtype)
    return (loss * agg_weights(mask.to(loss.dtype), agg, num_tokens=num_tokens, num_seqs=num_seqs)).sum()


def agg_weights(
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Per-token coefficients c [B, T] with agg_loss(l, mask, agg, ...) == (l * c).sum().

    The trainer packs sequences, so a loss is a weighted sum over packed tokens; these
    weights carry the aggregation (`width` stands for T of seq-mean-token-sum-norm, the
    longest response of the whole batch)."""
    mask = mask if mask.is_floating_point() else mask.to(torch.float32)
    seqs = float(mask.shape[0] if num_seqs is None else num_seqs)
    if agg == "token-mean":
        return mask / max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    if agg == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / max(seqs, 1.0)
    if agg == "seq-mean-token-sum":
        return mask / max(seqs, 1.0)
    if agg == "seq-mean-token-sum-norm":
        return mask / float(width or mask.shape[-1]) / max(seqs, 1.0)
    raise ValueError(f"algorithm.lossAgg: unknown aggregation {agg!r}; use one of {', '.join(AGGREGATIONS)}")


def ppo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss l [..] and a bool tensor of where the clip was active."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, clipped > unclipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped policy loss; returns (loss, metrics with clip_fraction and approx_kl).
    `is_weights` [B, T] (truncated importance sampling) multiply the per-token loss."""
    mask_f = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    loss, clip_active = ppo_token_loss(logprobs, old_logprobs, advantages, clip_low=clip_low, clip_high=clip_high,
                                       dual_clip=dual_clip)
    if is_weights is not None:
        loss = loss * is_weights
    n_valid = mask_f.sum().clamp(min=1.0)
    with torch.no_grad():
        metrics = {
            "clip_fraction": (clip_active.to(mask_f.dtype) * mask_f).sum() / n_valid,
            "approx_kl": (0.5 * log_ratio.square() * mask_f).sum() / n_valid,
        }
    return agg_loss(loss, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs), metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy [..] of the categorical distributions given by `logits` [.., V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def value_token_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     clip: float | None = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clip(V - V_old, -clip, clip), and where the clipped term won."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2), reduced with `agg`; all [B, T]. Returns (loss, metrics
    with value_clip_fraction)."""
    per_token, clip_active = value_token_loss(values, old_values, returns, clip)
    m = mask.to(values.dtype)
    frac = (clip_active.to(values.dtype) * m).sum() / m.sum().clamp(min=1.0)
    return agg_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs), {"value_clip_fraction": frac.detach()}


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): w = min(exp(old_logp - rollout_logp), cap) [B, T],
    correcting for the rollout engine's numerics differing from the trainer's."""
    return (old_logprobs - rollout_logprobs).exp().clamp(max=cap).detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens (1 is a perfect critic)."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return ((x - mean).square() * m).sum() / n

    var_r = var(returns)
    return 1 - var(returns - values) / var_r if var_r > 0 else torch.zeros((), dtype=values.dtype)
