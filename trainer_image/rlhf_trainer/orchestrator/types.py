"""What crosses the orchestrator -> trainer boundary: a step's sampled sequences (`Row`,
data/sequences.py) in one `RolloutBatch` with their statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..data.sequences import Row


@dataclass
class RolloutStats:
    """Rank 0's statistics of one step's rollout (logged as they are)."""

    reward_mean: float
    reward_std: float
    reward_min: float
    reward_max: float
    score_mean: float
    response_length_mean: float
    response_length_min: int
    response_length_max: int
    truncated_fraction: float
    """Responses cut at rollout.maxTokens (the clipped-response ratio)."""
    zero_std_group_fraction: float
    """Groups whose rewards are all equal, before dynamic sampling drops them."""
    dropped_group_fraction: float
    num_tokens: int
    """Prompt + response tokens of the step."""
    dropped_prompts: int = 0
    """Prompts skipped by the data source so far (too long or empty)."""
    skipped_rows: int = 0
    """Malformed rows of the dataset skipped when it was read."""
    components: dict[str, float] = field(default_factory=dict)
    """`reward/<name>_mean` of each reward function with `reward.components`."""
    reward_counters: dict[str, float] = field(default_factory=dict)
    """`reward/<name>_<counter>`: what the reward functions counted this step (a judge's
    `parse_failures` and `judge_tokens`)."""
    tools: dict[str, float] = field(default_factory=dict)
    """With `rollout.tools` or `rollout.agent`: tool_calls_mean, tool_errors, turns_mean, tool_failed_fraction
    (rollout/tool_episodes.py `episode_metrics`); with an agent also agent_failed_fraction."""


@dataclass
class RolloutBatch:
    """One step's groups, flattened: rows `g * group_size .. (g + 1) * group_size - 1`
    are the samples of prompt g."""

    rows: list[Row]
    group_size: int
    stats: RolloutStats
    step: int | None = None
    """The trainer step it was collected for."""
    policy_version: int | None = None
    """Generated ahead (`rollout.maxStaleness` >= 1): the policy version the servers held
    when its generation started (orchestrator/prefetch.py); None: generated for this step."""
    data_position: dict | None = None
    """Generated ahead: the data source's position after its prompts (what a checkpoint
    records, so a resume regenerates the batches generated ahead)."""
    staleness: int | None = None
    """Policy versions it lags behind the servers' when the trainer took it (rl/loop.py)."""
    token_staleness: dict[str, float] | None = None
    """Generated ahead: the per-token figures of orchestrator/staleness.py (`staleness_mean`,
    `staleness_max`, `stale_token_fraction`, `mixed_version_fraction`), set when the trainer
    takes it (prefetch.py)."""
    prompt_indices: list[int] | None = None
    """Partial rollouts (orchestrator/partial.py): the data source's index of each group's
    prompt, in the batch's order (groups are taken as they complete, not in index order)."""
