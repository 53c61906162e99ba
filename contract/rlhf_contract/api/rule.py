"""One cross-field rule of the job spec: a Python check and the same rule in CEL (rules.py
lists them), and the helpers for "required when"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Rule:
    field_path: str
    """Path of the field to blame, relative to `spec`, in YAML names."""
    cel: str
    """The rule as a CEL expression over `self` = the spec."""
    message: str
    """What is wrong and what to change (static; the CEL message)."""
    check: Callable[[Any], bool]
    """True when the spec (an `RLHFJobSpec`; rules import no model: models imports rules) satisfies the rule."""
    detail: Callable[[Any], str] = lambda s: ""
    """The values involved, appended to the message in Python."""

    def problem(self, detail: str = "") -> str:
        """`spec.<field>: <message> (<detail>)`, as `rlhfctl validate` and the trainer print it."""
        return f"spec.{self.field_path}: {self.message}" + (f" ({detail})" if detail else "")


def required_for_reward(reward_type: str, field: str, what: str) -> Rule:
    """`reward.<field>` must be set when `reward.type` is `reward_type`."""
    return Rule(
        field_path=f"reward.{field}",
        cel=f"self.reward.type != '{reward_type}' || has(self.reward.{field})",
        message=f"is required when reward.type is {reward_type} ({what})",
        check=lambda s: s.reward.type != reward_type or bool(getattr(s.reward, field)),
    )


def required_for_component(reward_type: str, field: str, what: str) -> Rule:
    """`reward.components[*].<field>` must be set on each component of type `reward_type`."""
    return Rule(
        field_path="reward.components",
        cel=f"!has(self.reward.components) || self.reward.components.all(c, c.type != '{reward_type}' || has(c.{field}))",
        message=f"each component of type {reward_type} needs {field} ({what})",
        check=lambda s: all(c.type != reward_type or bool(getattr(c, field)) for c in s.reward.components),
        detail=lambda s: "missing on " + ", ".join(c.name for c in s.reward.components
                                                  if c.type == reward_type and not getattr(c, field)),
    )
