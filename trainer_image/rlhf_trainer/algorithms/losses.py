"""The RL losses the trainer runs: the policy loss of a micro-batch (`compose_loss`), its
per-token parts, the loss aggregation as per-token weights, and the critic's loss.

Shapes: every function is elementwise over tokens, so a [B, T] table and the packed
[1, l] tokens of a micro-batch are both fine, except `agg_weights` and
`explained_variance`, which take [B, T] tables of the whole mini-batch.

Per token, with r = exp(logp - old) (old: the policy's log-prob before this step's
updates) and advantage A:
  PPO clip (Schulman et al. 2017, eq. 7, as a loss):
      l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
  dual clip (Ye et al. 2020), where A < 0:  l = min(l, -c A)
  GSPO (Zheng et al. 2025, policyLoss gspo): r replaced by s_t = sg[s] exp(logp - sg[logp]),
      s = exp(mean over the sequence's tokens of logp - old) (GSPO-token, eq. 13)
  CISPO (MiniMax-M1 2025, policyLoss cispo):  l = -sg[clip(r, 1 - clip_low, 1 + clip_high)] A logp
  rollout correction (`corrections.py`: TIS, token / sequence masks, two-sided masks):
      l = l * w, w detached; a token with w = 0 (masked) leaves the entropy and KL terms too
  entropy bonus (Schulman et al. 2017, eq. 9):  - entropyCoef * H
  KL in the loss (klMode loss; GRPO, Shao et al. 2024):  + klCoef * kl(logp, ref), with
      Schulman's k1 / k2 / k3 (`kl.py`)
The mini-batch loss is L = sum over its tokens of coef * (l - entropyCoef H [+ klCoef kl]),
coef = agg_weights(mask of the whole mini-batch, lossAgg), B rows, m = mask:
  token-mean               coef = m / sum(m)
  seq-mean-token-mean      coef = m / (row sum(m)) / B
  seq-mean-token-sum       coef = m / B
  seq-mean-token-sum-norm  coef = m / W / B     (Dr. GRPO, Liu et al. 2025)
coef is computed on the whole mini-batch and sliced per micro-batch, so the losses of
the micro-batches (any split of rows or tokens, over any ranks) sum to L.

Departures from the papers:
- separate clip_low / clip_high (DAPO's clip-higher, Yu et al. 2025); PPO has one epsilon;
- W of seq-mean-token-sum-norm is the longest response of the mini-batch (`width`), not
  Dr. GRPO's constant generation budget, so W varies between mini-batches;
- the entropy bonus and the KL term are reduced with the policy term's coef (GRPO
  averages its k3 KL per sequence, which is lossAgg seq-mean-token-mean);
- clip_active marks tokens where the clip(r) term is the larger one (the ratio clip is
  active; CISPO: where the weight was clipped); where the dual clip binds is not counted;
- GSPO with per-token advantages (gae, a KL penalty in the reward) is the paper's
  GSPO-token; with an aggregation other than seq-mean-token-mean its sequence terms are
  weighted by their lengths (the gspo preset uses seq-mean-token-mean);
- the value loss is PPO2's clipped squared error (OpenAI baselines, not in the PPO paper).
Not here: log-probs and entropy (`models/logprob_head.py`), backward and optimizer steps
(`rl/step.py`), advantages (`advantages.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from rlhf_contract.api.models import AlgorithmSpec, LossAgg

from .kl import kl_penalty

AGGREGATIONS: tuple[str, ...] = get_args(LossAgg)


@dataclass
class LossTerms:
    """Per-token tensors of one micro-batch besides the loss itself (for metrics)."""

    clip_active: torch.Tensor
    """Where the ratio clip was active (bool, the shape of logp)."""
    kl: torch.Tensor | None
    """The per-token KL estimate from the reference (None without one)."""


def compose_loss(a: AlgorithmSpec, *, logp: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor,
                 advantages: torch.Tensor, coef: torch.Tensor, ref: torch.Tensor | None = None,
                 correction: torch.Tensor | None = None,
                 seq_log_ratio: torch.Tensor | None = None) -> tuple[torch.Tensor, LossTerms]:
    """The policy loss of one micro-batch (the module docstring's L restricted to its
    tokens): sum of coef x (policy loss l [x correction weight w] - entropyCoef x entropy
    [+ klCoef x KL when klMode is loss]), l by `policyLoss`. All tensors have one shape
    (per packed token, [1, l]); `coef` carries the aggregation; `correction` (the weights of
    `corrections.rollout_correction`) is needed when `a.correction()` is set: a token whose
    weight is 0 was masked and drops out of every term; `seq_log_ratio` (each token's
    sequence mean of logp - old) is needed by gspo."""
    if a.policy_loss == "gspo":
        if seq_log_ratio is None:
            raise ValueError("algorithm.policyLoss is gspo: compose_loss needs the sequence log-ratios")
        token_loss, clip_active = gspo_token_loss(logp, seq_log_ratio, advantages, clip_low=a.clip_low,
                                                  clip_high=a.clip_high, dual_clip=a.dual_clip)
    elif a.policy_loss == "cispo":
        token_loss, clip_active = cispo_token_loss(logp, old, advantages, clip_low=a.clip_low, clip_high=a.clip_high)
    else:
        token_loss, clip_active = ppo_token_loss(logp, old, advantages, clip_low=a.clip_low, clip_high=a.clip_high,
                                                 dual_clip=a.dual_clip)
    if a.correction() is not None:
        if correction is None:
            raise ValueError("algorithm.rolloutCorrection (or tisCap) is set: compose_loss needs the correction "
                             "weights (corrections.rollout_correction)")
        token_loss = token_loss * correction.detach()
        coef = torch.where(correction != 0, coef, 0.0)  # a masked token leaves the whole loss
    loss = (token_loss * coef).sum()
    if a.entropy_coef:
        loss = loss - a.entropy_coef * (entropy * coef).sum()
    kl = None
    if ref is not None:
        kl = kl_penalty(logp, ref, a.kl_estimator)
        if a.kl_mode == "loss":
            loss = loss + a.kl_coef * (kl * coef).sum()
    return loss, LossTerms(clip_active, kl)


def agg_weights(
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Per-token coefficients coef [B, T] of the aggregation `agg` (module docstring) for
    the mini-batch `mask` [B, T]: sum(l * coef) is the aggregated loss of a per-token
    loss l. `num_tokens` / `num_seqs` default to the mask's token and row counts; `width`
    is W of seq-mean-token-sum-norm (default T = mask.shape[-1]). Empty rows count in B."""
    mask = mask if mask.is_floating_point() else mask.to(torch.float32)
    seqs = max(float(mask.shape[0] if num_seqs is None else num_seqs), 1.0)
    if agg == "token-mean":
        return mask / max(float(mask.sum()) if num_tokens is None else float(num_tokens), 1.0)
    if agg == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / seqs
    if agg == "seq-mean-token-sum":
        return mask / seqs
    if agg == "seq-mean-token-sum-norm":
        return mask / float(width or mask.shape[-1]) / seqs
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
    """Per-token PPO clip loss l (with the dual clip when `dual_clip` is c) and a bool
    tensor of where the ratio clip was active; all of one shape."""
    return clipped_objective((logprobs - old_logprobs).exp(), advantages, clip_low, clip_high, dual_clip)


def clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high)) [dual clip], and where
    the clipped term is the larger one."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * dual_clip), loss)
    return loss, clipped > unclipped


def gspo_token_loss(logprobs: torch.Tensor, seq_log_ratio: torch.Tensor, advantages: torch.Tensor, *,
                    clip_low: float, clip_high: float,
                    dual_clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token (Zheng et al. 2025, eq. 13): every token's ratio has the value of its
    sequence's ratio s = exp(mean over the sequence's tokens of logp - old), given per
    token in `seq_log_ratio` (detached here), and the gradient of its own log-prob:
    s_t = sg[s] x exp(logp - sg[logp]). With one advantage per sequence this is GSPO's
    sequence objective (eq. 5) spread over the sequence's tokens, and its gradient."""
    ratio = (seq_log_ratio.detach() + logprobs - logprobs.detach()).exp()
    return clipped_objective(ratio, advantages, clip_low, clip_high, dual_clip)


def cispo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                     clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eq. 4): l = -sg[clip(r, 1 - clip_low, 1 + clip_high)]
    x A x logp, r = exp(logp - old): the weight is clipped and detached, so no token loses
    its gradient; and where the weight was clipped."""
    ratio = (logprobs.detach() - old_logprobs).exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, weight != ratio


def sequence_means(values: torch.Tensor, mask: torch.Tensor, segments: list[range]) -> torch.Tensor:
    """Each segment's masked mean of `values` (one packed row [1, L] or [L]), written over
    the segment's positions (0 elsewhere): GSPO's length-normalised log-ratio per sequence."""
    flat, m = values.reshape(-1), mask.reshape(-1).to(values.dtype)
    out = torch.zeros_like(flat)
    for seg in segments:
        n = m[seg.start:seg.stop].sum()
        if n > 0:
            out[seg.start:seg.stop] = (flat[seg.start:seg.stop] * m[seg.start:seg.stop]).sum() / n
    return out.reshape(values.shape)


def value_token_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     clip: float | None = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clip(V - V_old, -clip, clip) (PPO2), and where the clipped term won;
    `clip` None: 0.5 * (V - R)^2. The trainer reduces it token-mean."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens of [B, T] tables (1: a perfect critic;
    0 when the returns do not vary)."""
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * m).sum() / n
        return ((x - mean).square() * m).sum() / n

    var_r = var(returns)
    return 1 - var(returns - values) / var_r if var_r > 0 else torch.zeros((), dtype=values.dtype)
