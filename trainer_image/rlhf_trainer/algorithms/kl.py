"""Per-token KL estimators between the policy and a reference policy.

Schulman, "Approximating KL Divergence" (2020). With log-ratio d = logp - ref_logp,
all [B, T]:
  k1 = d                          (unbiased, high variance, can be negative)
  k2 = d**2 / 2                   (biased, low variance)
  k3 = exp(-d) - (-d) - 1         (unbiased, low variance, >= 0)
"""

from __future__ import annotations

import torch


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate [B, T] of the policy from the reference."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = -log_ratio
        return neg.exp() - neg - 1.0
    raise ValueError(f"algorithm.klEstimator: unknown estimator {estimator!r}; use k1, k2 or k3")
