"""A step's per-token tensors ([B, T] tables, `StepTensors`) and how they are made: the
no-gradient passes (old / reference log-probs, the critic's values), the token rewards
with an optional KL penalty, and the advantages.

Every rank forwards its own micro-batches; the per-sequence results are all-gathered so
that every rank computes the same advantages on the whole batch (group statistics and
batch whitening are exact whatever the number of processes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_contract.api.models import AlgorithmSpec

from ..algorithms.advantages import compute_advantages, gae
from ..algorithms.kl import kl_penalty
from ..orchestrator.types import Row, pad_rows
from .micro_batches import MicroBatch, whole_row


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
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def needs_old_logprobs(a: AlgorithmSpec) -> bool:
    """With one optimizer step, no KL in the reward and no TIS, the old log-probs equal the
    current ones at the first (only) pass: skip the extra forward (GRPO's shortcut)."""
    return a.num_mini_batches > 1 or (bool(a.kl_coef) and a.kl_mode == "reward") or a.tis_cap is not None


def gather_passes(rows: list[Row], micro_batches: list[MicroBatch], passes: dict[str, Callable[[MicroBatch], torch.Tensor]],
                  cp_mesh, world_size: int) -> dict[str, torch.Tensor]:
    """Run each no-grad pass over this rank's micro-batches and return, for every pass, the
    whole batch's [B, T] table (every rank gets the same tables)."""
    width = max(max((len(r.response_ids) for r in rows), default=1), 1)
    local: dict[str, dict[int, torch.Tensor]] = {k: {} for k in passes}
    with torch.no_grad():
        for mb in micro_batches:
            for name, fn in passes.items():
                for i, values in zip(mb.rows, mb.gather(whole_row(fn(mb), cp_mesh))):
                    local[name][i] = values
    if world_size > 1 and passes:
        parts: list = [None] * world_size
        dist.all_gather_object(parts, local)
        for part in parts:  # tensor / context parallel peers hold identical copies
            for name in passes:
                local[name].update(part[name])
    return {name: pad_rows([local[name][i].tolist() for i in range(len(rows))], width) for name in passes}


def build_step_tensors(rows: list[Row], tables: dict[str, torch.Tensor], a: AlgorithmSpec,
                       group_size: int) -> StepTensors:
    """Token rewards (outcome on the last response token, minus the KL penalty when
    `klMode` is `reward`), returns (GAE) and advantages, from the gathered tables."""
    width = max(max((len(r.response_ids) for r in rows), default=1), 1)
    mask = pad_rows([r.mask() for r in rows], width)
    t = StepTensors(mask=mask, advantages=torch.zeros_like(mask),
                    rollout_logprobs=pad_rows([r.rollout_logprobs for r in rows], width),
                    old_logprobs=tables.get("old_logprobs"), ref_logprobs=tables.get("ref_logprobs"),
                    values=tables.get("values"))
    token_rewards = torch.zeros_like(mask)
    for i, r in enumerate(rows):
        if r.response_ids:
            token_rewards[i, len(r.response_ids) - 1] = r.reward
    if t.ref_logprobs is not None and a.kl_mode == "reward":
        token_rewards = token_rewards - a.kl_coef * kl_penalty(t.old_logprobs, t.ref_logprobs, a.kl_estimator) * mask
    if a.advantage_estimator == "gae":
        _, t.returns = gae(token_rewards, t.values, mask, a.gamma, a.lam)
    t.advantages = compute_advantages(a.advantage_estimator, token_rewards, mask, group_size=group_size,
                                      values=t.values, gamma=a.gamma, lam=a.lam, norm_std=a.norm_std)
    return t
