"""Verifiable rewards: `reward(response_text, answer) -> float`.

Simplification: only the string rewards for now; math (math-verify), sandboxed code and
multi-turn environments come later.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    return float(response.strip() == answer.strip())


def prefix_match(response: str, answer: str) -> float:
    """1.0 when the stripped response starts with the stripped answer."""
    return float(response.strip().startswith(answer.strip()))


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "prefix_match": prefix_match}


def get_reward_fn(name: str) -> RewardFn:
    if name not in REWARDS:
        raise ValueError(f"reward.type: unknown reward {name!r}; choose one of {', '.join(REWARDS)}")
    return REWARDS[name]
