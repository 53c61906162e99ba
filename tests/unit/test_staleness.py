"""Per-token staleness (orchestrator/staleness.py): each token's lag behind the trained
policy, tokens past the bound out of the loss, the step's figures, against a plain loop."""

from __future__ import annotations

from rlhf_trainer.data.sequences import Row
from rlhf_trainer.orchestrator.staleness import bound_stale_tokens
from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats


def row(versions, loss_mask=None, n=None):
    n = n if n is not None else len(versions)
    return Row([1, 2], list(range(n)), [0.0] * n, 0.0, 0.0, False, loss_mask=loss_mask, versions=versions)


def batch(rows, start):
    return RolloutBatch(rows, 1, RolloutStats(*[0] * 12), policy_version=start)


def test_tokens_past_the_bound_leave_the_loss_and_the_figures_are_per_token():
    rows = [
        row([3, 3, 4, 5]),  # spans three versions; lags 2 2 1 0 behind version 5
        row([5, 5]),
        row(None, n=3),  # a server that labels nothing (vLLM's /v1/completions): the batch's start, 3
        row([4, None, 5], loss_mask=[1, 0, 1]),  # an environment token (mask 0) is not counted
    ]
    b = batch(rows, start=3)
    figures = bound_stale_tokens(b, trained_version=5, max_staleness=1)
    assert rows[0].loss_mask == [0, 0, 1, 1]
    assert rows[1].loss_mask is None  # nothing masked: left as it was
    assert rows[2].loss_mask == [0, 0, 0]
    assert rows[3].loss_mask == [1, 0, 1]
    # the same by a plain loop over (lag, counted) pairs
    tokens = [(2, 1), (2, 1), (1, 1), (0, 1), (0, 1), (0, 1), (2, 1), (2, 1), (2, 1), (1, 1), (0, 1)]
    kept = [lag for lag, _ in tokens if lag <= 1]
    assert figures["staleness_mean"] == sum(kept) / len(kept)
    assert figures["staleness_max"] == 1.0
    assert figures["stale_token_fraction"] == 5 / 11
    assert figures["mixed_version_fraction"] == 2 / 4  # rows 0 and 3 (its None reads as the start, 3)


def test_a_batch_within_the_bound_is_untouched():
    rows = [row([2, 2, 3]), row([3])]
    figures = bound_stale_tokens(batch(rows, start=2), trained_version=3, max_staleness=1)
    assert [r.loss_mask for r in rows] == [None, None]
    assert figures == {"staleness_mean": 1 / 4 * 2, "staleness_max": 1.0, "stale_token_fraction": 0.0,
                       "mixed_version_fraction": 0.5}
