"""The job's methods (`spec.method`) and their facts as data: every module that branches
on a method reads its `MethodFacts` (whether it rolls out and syncs weights, trains on
pairs, has an LM head, which reference model it compares against, whether its loss is a
policy loss) instead of comparing method names."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


@dataclass(frozen=True)
class MethodFacts:
    """What a method is, as data: every module that branches on a method asks its facts
    (`Method(...).facts`) instead of comparing names."""

    rollouts: bool
    """Samples from the policy on rollout servers, so the trainer syncs its weights to them
    after each step; False: trains from the dataset alone."""
    pairs: bool
    """Trains on preference pairs (chosen, rejected)."""
    lm_head: bool
    """Trains a causal LM (log-probs over the vocabulary); False: a one-label score head."""
    reference: Literal["none", "kl", "always", "teacher"]
    """The frozen model the loss compares against: `kl` the starting model when
    `algorithm.klCoef` != 0, `always` the starting model, `teacher` `distillation.teacher`."""
    policy_loss: bool
    """Its loss is an RL policy loss over sampled tokens (rl/step.py); False: an offline loss."""


class Method(StrEnum):
    """How a job learns (`spec.method`). A `StrEnum`: it equals its YAML string."""

    RL = "rl"
    """Rollouts from the policy, scored by `reward`."""
    SFT = "sft"
    """Supervised fine-tuning on the dataset's responses."""
    RM = "rm"
    """A reward model (Bradley-Terry) from preference pairs."""
    DPO = "dpo"
    """Direct preference optimization against the frozen starting model."""
    DISTILL = "distill"
    """On-policy distillation: rollouts from the policy (the student), every sampled token
    scored by a frozen teacher (`distillation`)."""

    @property
    def facts(self) -> MethodFacts:
        return METHOD_FACTS[self]

    @property
    def offline(self) -> bool:
        """Trains from the dataset alone: no rollout servers."""
        return not self.facts.rollouts

    @property
    def syncs_weights(self) -> bool:
        """The trainer sends its weights to the rollout servers after each step."""
        return self.facts.rollouts

    @property
    def pairs(self) -> bool:
        """Trains on preference pairs (chosen, rejected)."""
        return self.facts.pairs


METHOD_FACTS: dict[Method, MethodFacts] = {
    Method.RL: MethodFacts(rollouts=True, pairs=False, lm_head=True, reference="kl", policy_loss=True),
    Method.SFT: MethodFacts(rollouts=False, pairs=False, lm_head=True, reference="none", policy_loss=False),
    Method.RM: MethodFacts(rollouts=False, pairs=True, lm_head=False, reference="none", policy_loss=False),
    Method.DPO: MethodFacts(rollouts=False, pairs=True, lm_head=True, reference="always", policy_loss=False),
    Method.DISTILL: MethodFacts(rollouts=True, pairs=False, lm_head=True, reference="teacher", policy_loss=True),
}
"""Each method's facts (see MethodFacts): the one table the trainer, the plan and the
launcher read."""
