"""DAPO dynamic sampling (Yu et al. 2025): a group whose samples all scored the same
carries no group-relative signal; drop it and sample more prompts, at most
`algorithm.maxSamplingRounds` rounds per step, then fill with dropped groups (whose
group advantages are zero)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..algorithms.advantages import groups_with_signal
from ..data.sequences import Row


def has_signal(group: list[Row]) -> bool:
    """True when the group's scores are not all equal (DAPO filters on accuracy, not on
    the shaped reward)."""
    scores = torch.tensor([row.score for row in group])
    return bool(groups_with_signal(scores, len(group))[0])


def collect_groups(sample: Callable[[int, int], list[list[Row]]], need: int, *, dynamic: bool,
                   max_rounds: int) -> tuple[list[list[Row]], int, int]:
    """`sample(num_prompts, round)` until `need` groups are kept. Returns (groups, groups
    sampled, groups dropped)."""
    kept: list[list[Row]] = []
    dropped: list[list[Row]] = []
    sampled = 0
    for round_ in range(max_rounds if dynamic else 1):
        groups = sample(need - len(kept), round_)
        sampled += len(groups)
        for g in groups:
            (kept if not dynamic or has_signal(g) else dropped).append(g)
        if len(kept) == need:
            break
    num_dropped = len(dropped)
    kept += dropped[:need - len(kept)]
    return kept, sampled, num_dropped
