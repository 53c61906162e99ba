"""A step's per-token tensors ([B, T] tables, `StepTensors`) and how they are made: the
no-gradient passes (old / reference / teacher log-probs, the critic's values), the token
rewards with an optional KL penalty, and the advantages (`method: distill`: the teacher's
per-token signal, `distillation_advantages`).

Every rank forwards its own micro-batches; the per-token results are assembled into
whole-batch tables with one all-reduce on the device, so that every rank computes the
same advantages on the whole batch (group statistics and batch whitening are exact
whatever the number of processes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhf_contract.api.models import AlgorithmSpec, DistillationSpec

from ..algorithms.advantages import compute_advantages, gae
from ..algorithms.corrections import correction_metrics, rollout_correction
from ..algorithms.kl import kl_penalty
from ..data.micro_batches import MicroBatch
from ..data.sequences import Row, pad_rows
from ..models.forward import whole_row


@dataclass
class StepTensors:
    """[B, T] tables of one step (row i's response tokens in columns 0..len-1)."""

    mask: torch.Tensor
    """1 on trained response tokens."""
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    """The rollout engine's log-probs of the sampled tokens."""
    old_logprobs: torch.Tensor | None = None
    """The policy's log-probs before this step's updates (None: the step's first pass
    is on-policy and uses its own detached log-probs)."""
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    """`method: distill`: the teacher's log-probs of the sampled tokens."""
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    correction: torch.Tensor | None = None
    """`algorithm.rolloutCorrection`'s weight of each token (0: masked; None: no correction)."""
    reward_metrics: dict[str, float] = field(default_factory=dict)
    """Metrics of the preparation: the learned reward model's (`reward.model`, the step's
    total reward mean included: the rows keep their verifiable rewards), distillation's and
    the rollout correction's."""


def needs_old_logprobs(a: AlgorithmSpec, distill: bool = False) -> bool:
    """With one optimizer step, no KL in the reward, no rollout correction and no distillation (whose
    advantages read the student's log-probs), the old log-probs equal the current ones at
    the first (only) pass: skip the extra forward (GRPO's shortcut)."""
    return (a.num_mini_batches > 1 or (bool(a.kl_coef) and a.kl_mode == "reward") or a.correction() is not None
            or distill)


def gather_passes(rows: list[Row], micro_batches: list[MicroBatch], passes: dict[str, Callable[[MicroBatch], torch.Tensor]],
                  cp_mesh, world_size: int, *, contributes: bool = True,
                  device: torch.device = torch.device("cpu")) -> dict[str, torch.Tensor]:
    """Run each no-grad pass over this rank's micro-batches and return, for every pass, the
    whole batch's [B, T] table on the CPU (every rank gets the same tables).

    Each rank writes its own rows into zero tables on the device; one all-reduce SUM of
    the stacked tables over the world then assembles the batch (exact: each entry is one
    rank's value plus zeros). Tensor / context parallel peers hold identical rows, so
    only one of them (`contributes`) writes them.
    """
    width = max(max((len(r.response_ids) for r in rows), default=1), 1)
    if not passes:
        return {}
    tables = torch.zeros(len(passes), len(rows), width, dtype=torch.float32, device=device)
    with torch.no_grad():
        for mb in micro_batches:
            # (row, column) of each predicted response token and its packed position
            row_idx, col_idx, pos_idx = [], [], []
            for k, i in enumerate(mb.rows):
                pos = mb.positions(k)
                row_idx += [i] * len(pos)
                col_idx += range(len(pos))
                pos_idx += pos
            index = [torch.tensor(x, dtype=torch.long, device=device) for x in (row_idx, col_idx, pos_idx)]
            for j, fn in enumerate(passes.values()):
                values = whole_row(fn(mb), cp_mesh)[0]
                if contributes:
                    tables[j, index[0], index[1]] = values[index[2]].float()
    if world_size > 1:
        dist.all_reduce(tables)
    tables = tables.cpu()
    return {name: tables[j] for j, name in enumerate(passes)}


def distillation_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                            task: torch.Tensor | None = None, reward_weight: float = 0.0,
                            baseline: str = "none") -> torch.Tensor:
    """On-policy distillation's per-token advantage: the negative reverse-KL estimate
    -(log p_student - log p_teacher) of each sampled token (the student sampled it, so its
    mean is -KL(student || teacher)), minus `position_baseline` of it when `baseline` is
    `position`, plus `reward_weight` x the task advantages `task`; 0 off the mask. All [B, T]."""
    adv = (teacher - student) * mask
    if baseline == "position":
        adv = adv - position_baseline(adv, mask)
    if task is not None and reward_weight:
        adv = adv + reward_weight * task * mask
    return adv


def position_baseline(signal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each masked token's baseline: the mean `signal` of the OTHER masked tokens in its
    column (the same response position in the step's other rows); 0 where a column has no
    other token. It does not depend on the token's own sample, so subtracting it leaves the
    policy gradient unbiased. [B, T]."""
    total, count = (signal * mask).sum(0, keepdim=True), mask.sum(0, keepdim=True)
    others = (count - mask).clamp(min=1.0)
    return (total - signal * mask) / others * mask * (count - mask > 0)


def distillation_metrics(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Per-token means over the mask: the reverse-KL estimate, the teacher's and the
    student's log-probs of the sampled tokens."""
    n = mask.sum().clamp(min=1.0)
    return {"distill_reverse_kl": float(((student - teacher) * mask).sum() / n),
            "distill_teacher_logprob": float((teacher * mask).sum() / n),
            "distill_student_logprob": float((student * mask).sum() / n)}


def build_step_tensors(rows: list[Row], tables: dict[str, torch.Tensor], a: AlgorithmSpec,
                       group_size: int, rewards: list[float] | None = None,
                       distillation: DistillationSpec | None = None) -> StepTensors:
    """Token rewards (outcome on the last response token, minus the KL penalty when
    `klMode` is `reward`), returns (GAE) and advantages, from the gathered tables.
    `rewards`: each row's outcome reward (default: the rows' own). With `distillation`
    the advantages are `distillation_advantages` (the task's only with a rewardWeight)."""
    width = max(max((len(r.response_ids) for r in rows), default=1), 1)
    mask = pad_rows([r.mask() for r in rows], width)
    t = StepTensors(mask=mask, advantages=torch.zeros_like(mask),
                    rollout_logprobs=pad_rows([r.rollout_logprobs for r in rows], width),
                    old_logprobs=tables.get("old_logprobs"), ref_logprobs=tables.get("ref_logprobs"),
                    teacher_logprobs=tables.get("teacher_logprobs"), values=tables.get("values"))
    if (spec := a.correction()) is not None:
        c = rollout_correction(spec, t.old_logprobs, t.rollout_logprobs, mask)
        t.correction = c.weights
        t.reward_metrics.update(correction_metrics(c, mask))
    token_rewards = torch.zeros_like(mask)
    for i, (r, reward) in enumerate(zip(rows, rewards if rewards is not None else [r.reward for r in rows])):
        if r.response_ids:
            token_rewards[i, len(r.response_ids) - 1] = reward
    if t.ref_logprobs is not None and a.kl_mode == "reward":
        token_rewards = token_rewards - a.kl_coef * kl_penalty(t.old_logprobs, t.ref_logprobs, a.kl_estimator) * mask
    if a.advantage_estimator == "gae":
        _, t.returns = gae(token_rewards, t.values, mask, a.gamma, a.lam)
    task = None
    if distillation is None or distillation.reward_weight:
        task = compute_advantages(a.advantage_estimator, token_rewards, mask, group_size=group_size,
                                  values=t.values, gamma=a.gamma, lam=a.lam, norm_std=a.norm_std)
    if distillation is None:
        t.advantages = task
        return t
    t.advantages = distillation_advantages(t.old_logprobs, t.teacher_logprobs, mask, task, distillation.reward_weight,
                                           distillation.baseline)
    t.reward_metrics.update(distillation_metrics(t.old_logprobs, t.teacher_logprobs, mask))
    return t
