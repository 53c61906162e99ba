"""Algorithm presets: each a documented set of defaults that any single field overrides.

A field of `spec.algorithm` left unset (null) takes the preset's value; a field you set
wins. The resolved values are what the trainer reads (the config mounted into pods is
the resolved job), so a preset can change in a later release without changing a running
job. docs/reference.md's preset table is generated from PRESETS.
"""

from __future__ import annotations

from typing import Any


_COMMON: dict[str, Any] = {
    "policy_loss": "ppo", "num_mini_batches": 1, "norm_std": False, "loss_agg": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0,
    "kl_estimator": "k3", "kl_mode": "loss", "gamma": 1.0, "lam": 1.0, "critic": False, "value_clip": 0.2,
    "dynamic_sampling": False, "overlong_buffer": 0,
}

PRESETS: dict[str, dict[str, Any]] = {
    # PPO (Ouyang et al. 2022 style): critic + GAE, KL to the reference in the reward
    "ppo": {**_COMMON, "advantage_estimator": "gae", "critic": True, "norm_std": True, "lam": 0.95,
            "kl_coef": 0.01, "kl_estimator": "k1", "kl_mode": "reward"},
    # DeepSeekMath GRPO: group std normalisation, sequence-level averaging, k3 KL as a loss
    "grpo": {**_COMMON, "advantage_estimator": "grpo", "norm_std": True, "loss_agg": "seq-mean-token-mean",
             "kl_coef": 0.04, "kl_estimator": "k3", "kl_mode": "loss"},
    # Dr. GRPO: no std normalisation, constant normaliser (sum / maxTokens), no KL
    "dr_grpo": {**_COMMON, "advantage_estimator": "dr_grpo", "loss_agg": "seq-mean-token-sum-norm"},
    # DAPO: clip-higher, token-level loss, dynamic sampling, soft overlong punishment, no KL
    "dapo": {**_COMMON, "advantage_estimator": "grpo", "norm_std": True, "clip_high": 0.28,
             "dynamic_sampling": True, "overlong_buffer": "maxTokens/5"},  # DAPO: 4096 of 20480
    # RLOO: leave-one-out baseline, no KL
    "rloo": {**_COMMON, "advantage_estimator": "rloo"},
    # REINFORCE++: discounted token returns whitened over the batch, k1 KL in the reward
    "reinforce_pp": {**_COMMON, "advantage_estimator": "reinforce_pp", "kl_coef": 0.01, "kl_estimator": "k1",
                     "kl_mode": "reward"},
    # REINFORCE++-baseline: group mean baseline then batch whitening, k2 KL as a loss
    "reinforce_pp_baseline": {**_COMMON, "advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.001,
                              "kl_estimator": "k2", "kl_mode": "loss"},
    # GSPO (Zheng et al. 2025, arXiv 2507.18071, sec. 5.1): the sequence ratio clipped to
    # [1 - 3e-4, 1 + 4e-4], group-normalised advantages, the sequence-mean objective, no KL,
    # each rollout batch split into 4 mini-batches (with one, the ratio is always 1)
    "gspo": {**_COMMON, "policy_loss": "gspo", "advantage_estimator": "grpo", "norm_std": True,
             "loss_agg": "seq-mean-token-mean", "clip_low": 3e-4, "clip_high": 4e-4, "num_mini_batches": 4},
    # CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): detached clipped importance weight x A x
    # log-prob, token-level mean, group-normalised advantages, no KL; no lower bound on the
    # weight (clipLow 1: weight >= 0), only the upper one is tuned (the paper gives no value;
    # 4: weights at most 5)
    "cispo": {**_COMMON, "policy_loss": "cispo", "advantage_estimator": "grpo", "norm_std": True,
              "clip_low": 1.0, "clip_high": 4.0},
}


METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    # the frozen model a distill job scores with is the teacher: no KL to the starting model
    "distill": {"kl_coef": 0.0},
}
"""Fields that a method resolves (when unset) before any preset does."""


def preset_value(preset: str, field: str, spec: Any) -> Any:
    value = PRESETS[preset][field]
    if value == "maxTokens/5":
        return spec.rollout.max_tokens // 5
    return value


def _cel_literal(value: Any) -> str:
    if value == "maxTokens/5":
        return "self.rollout.maxTokens / 5"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def cel_resolved(field: str, yaml_name: str) -> str:
    """A CEL expression (over `self` = the spec) for the value the field resolves to:
    the user's value if set, else the preset's. Generated from PRESETS, so the admission
    rules see the same resolved values as Python."""
    by_preset = "".join(
        f"self.algorithm.preset == '{name}' ? {_cel_literal(values[field])} : " for name, values in PRESETS.items()
    )
    by_method = "".join(f"self.method == '{method}' ? {_cel_literal(values[field])} : "
                        for method, values in METHOD_DEFAULTS.items() if field in values)
    return (f"(has(self.algorithm) && has(self.algorithm.{yaml_name}) ? self.algorithm.{yaml_name} : {by_method}"
            f"(!has(self.algorithm) ? {_cel_literal(PRESETS['grpo'][field])} : {by_preset}"
            f"{_cel_literal(PRESETS['grpo'][field])}))")


def apply_preset(spec: Any) -> None:
    """Fill every unset algorithm field from the preset (in place)."""
    algo = spec.algorithm
    for field, value in METHOD_DEFAULTS.get(str(spec.method), {}).items():
        if getattr(algo, field) is None:
            setattr(algo, field, value)
    for field in PRESETS[algo.preset]:
        if getattr(algo, field) is None:
            setattr(algo, field, preset_value(algo.preset, field, spec))


def preset_table() -> str:
    """The preset table of docs/reference.md (a test checks it holds exactly this)."""
    fields = ["advantage_estimator"] + [f for f in _COMMON]
    from pydantic.alias_generators import to_camel

    head = "| preset | " + " | ".join(to_camel(f) for f in fields) + " |"
    rule = "|" + "---|" * (len(fields) + 1)
    rows = []
    for name, values in PRESETS.items():
        cells = []
        for f in fields:
            v = values[f]
            cells.append("true" if v is True else "false" if v is False else str(v))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])
