"""The offline losses (sft, rm, dpo), each a short pure function of per-token or
per-sequence tensors; `offline/step.py` runs them and divides each micro-batch's sum by
the step's token or pair count.

Shapes: [P] one entry per preference pair (sequence log-probs: sums over the response's
trained tokens), [N] per token (any shape, elementwise).

  sft  -sum_t m_t log pi(y_t | y_<t)
  rm   Bradley-Terry (Ouyang et al. 2022): -log sigma(r_c - r_r)
  dpo  (Rafailov et al. 2023): -log sigma(beta h),
       h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))
  ipo  (Azar et al. 2023): (h - 1 / (2 tau))^2, tau = `beta`

Departures from the papers: label smoothing eps (conservative DPO, Mitchell 2023) mixes in
the loss of the flipped label, -(1 - eps) log sigma(x) - eps log sigma(-x), for dpo and
also for rm (InstructGPT has none). As in the IPO paper, h uses summed log-probs, not
per-token means.
Not here: log-probs or scores (models/forward.py), the division by the step's counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sft_loss_sum(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood summed over trained tokens: -sum_t mask_t log pi(y_t | y_<t).
    logp, mask: [N] (or the packed [1, L]). The caller divides by the step's token count."""
    return -(logp * mask).sum()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Reward-model loss per pair [P]: -log sigma(r_c - r_r) (Bradley-Terry; InstructGPT),
    with label smoothing eps: -(1 - eps) log sigma(d) - eps log sigma(-d)."""
    d = chosen - rejected
    return -(1 - label_smoothing) * F.logsigmoid(d) - label_smoothing * F.logsigmoid(-d)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO per pair [P] from sequence log-probs (sums over response tokens) [P] each.

        h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r))
        sigmoid (Rafailov et al. 2023; eps = label smoothing, cDPO):
            -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
        ipo (Azar et al. 2023):  (h - 1 / (2 beta))^2

    Returns (loss [P], chosen reward beta (log pi - log pi_ref)(y_c) [P], rejected reward [P]).
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"preference.lossType: unknown {loss_type!r}; use sigmoid or ipo")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
