"""The rollout correction (`algorithm.rolloutCorrection`): per-token weights that correct the
policy loss for the rollout engine's sampling distribution differing from the trainer's
(another kernel, precision or quantisation; with `rollout.maxStaleness`, older weights).

[B, T] tables, m the response mask, per token the importance ratio
    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_t - rollout_t)
(old: the trainer's log-prob before this step's updates; rollout: the engine's). The policy
loss of each token is multiplied by w_t, detached:
  tis             w_t = min(rho_t, upper)
                  (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly
                  Brings You Off-Policy RL Training")
  token-mask      w_t = rho_t 1[lower <= rho_t <= upper]
                  (token-level masked IS; Liu, Li et al. 2025, "When Speed Kills Stability:
                  Demystifying RL Collapse from the Training-Inference Mismatch")
  sequence-mask   w_t = rho_i 1[lower <= rho_i <= upper] on every token t of sequence i, with
                  rho_i = exp(sum_t m_t (old_t - rollout_t) / sum_t m_t)
                  (sequence-level masked IS of the same post, with the sequence ratio
                  length-normalised: the geometric mean of the token ratios, which is GSPO's
                  sequence importance ratio s_i, Zheng et al. 2025, "Group Sequence Policy
                  Optimization", sec. 4.1)
  two-sided-mask  token-mask with both bounds (IcePop's M(k) = k on [alpha, beta], else 0;
                  Ling Team 2025, "Small Leak Can Sink a Great Ship: Boost RL Training on
                  MoE with IcePop!")
`lower` unset: no lower bound. Off the mask w = 0.

Departures and choices:
- the masked IS post's sequence ratio is the product of the token ratios; the geometric mean
  is used instead so that one threshold fits every length (a product over 1,000 tokens
  under- or overflows and is masked for any small per-token drift);
- a masked token leaves the whole loss (its policy term, entropy bonus and KL term:
  `losses.compose_loss`), but still counts in `lossAgg`'s denominators, as in the papers'
  estimators (1/|y| or 1/G over all samples): masking lowers the step's effective size
  rather than re-weighting the surviving tokens;
- a ratio exactly on a bound is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_contract.api.task import CORRECTION_MODES, RolloutCorrectionSpec


@dataclass
class Correction:
    """The weights of one step's tokens and where they were masked."""

    weights: torch.Tensor
    """w [B, T], detached; 0 off the response mask and on masked tokens."""
    masked: torch.Tensor
    """[B, T] bool: response tokens masked out of the loss (all False for tis)."""


def importance_ratios(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
                      level: str = "token") -> torch.Tensor:
    """rho [B, T]: each token's exp(old - rollout) (`level` token), or its sequence's geometric
    mean exp(masked mean of old - rollout over the row) on every column (`level` sequence;
    1 for an empty row)."""
    log_ratio = (old - rollout).detach()
    if level == "token":
        return log_ratio.exp()
    m = mask.to(log_ratio.dtype)
    seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return seq.exp().expand_as(log_ratio)


def rollout_correction(spec: RolloutCorrectionSpec, old: torch.Tensor, rollout: torch.Tensor,
                       mask: torch.Tensor) -> Correction:
    """The module docstring's w for `spec` on [B, T] tables of the trainer's (`old`) and the
    rollout engine's (`rollout`) log-probs of the sampled tokens and the response `mask`."""
    if spec.mode not in CORRECTION_MODES:
        raise ValueError(f"algorithm.rolloutCorrection.mode: unknown mode {spec.mode!r}; use one of "
                         f"{', '.join(CORRECTION_MODES)}")
    if spec.upper is None:
        raise ValueError(f"algorithm.rolloutCorrection.upper is required with mode {spec.mode}")
    valid = mask.bool()
    if spec.mode == "tis":
        weights = importance_ratios(old, rollout, mask).clamp(max=spec.upper)
        return Correction(torch.where(valid, weights, 0.0), torch.zeros_like(valid))
    if spec.mode == "two-sided-mask" and spec.lower is None:
        raise ValueError("algorithm.rolloutCorrection.lower is required with mode two-sided-mask")
    rho = importance_ratios(old, rollout, mask, "sequence" if spec.mode == "sequence-mask" else "token")
    inside = rho <= spec.upper
    if spec.lower is not None:
        inside &= rho >= spec.lower
    return Correction(torch.where(valid & inside, rho, 0.0), valid & ~inside)


def correction_metrics(c: Correction, mask: torch.Tensor) -> dict[str, float]:
    """`rollout_correction_masked_fraction` (masked response tokens over all of them) and
    `rollout_correction_weight_mean` (the mean weight of the tokens kept)."""
    valid = mask.bool()
    kept = valid & ~c.masked
    return {"rollout_correction_masked_fraction": float(c.masked.sum() / valid.sum().clamp(min=1)),
            "rollout_correction_weight_mean": float(c.weights[kept].sum() / kept.sum().clamp(min=1))}
