"""What a reward function sees of one response (re-exported by `rlhf_trainer.rewards`)."""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Sample(NamedTuple):
    """What a reward function sees of one response."""

    response: str
    answer: str
    """The row's reference answer (data.answerKey), "" when it has none."""
    extra_info: dict
    """Every column of the row, under its own name."""
    prompt: str | list[dict] = ""
    """The prompt: the row's text, or its chat turns (TRL's `prompts`)."""
    completion_ids: Sequence[int] = ()
    """The response's token ids."""
