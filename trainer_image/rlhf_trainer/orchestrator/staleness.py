"""Per-token staleness of a batch generated ahead (`rollout.maxStaleness` = k >= 1).

With `rollout.inFlightUpdates` a response may span weight updates: its first tokens were
sampled by version v, its last ones by v + 1 or later (the servers pause with mode "keep",
load the new weights and go on). Each token's version comes from the server (`Row.versions`,
the CPU engine's `weight_versions` spans); where a server reports none (vLLM's
/v1/completions), a token gets the version the servers held when the batch started
(`policy_version`), a lower bound, so the lag is never under-stated.

`bound_stale_tokens` takes a token out of the loss (`Row.loss_mask` 0) when it lags the
trained policy by more than k versions, and returns the step's per-token figures. The
importance correction needs nothing more: each token's rollout log-prob is the one of the
version that sampled it, so `algorithm.rolloutCorrection` (tis, token-mask, ...) weighs
each token by its own ratio. The producer's gate (prefetch.py) already keeps every token
within k versions; the mask is the bound stated per token, not a second gate.
"""

from __future__ import annotations

from .types import RolloutBatch


def token_versions(versions: list[int | None] | None, num_tokens: int, fallback: int) -> list[int]:
    """Each response token's version; `fallback` where the server labelled none."""
    if versions is None:
        return [fallback] * num_tokens
    return [fallback if v is None else v for v in versions]


def bound_stale_tokens(batch: RolloutBatch, *, trained_version: int, max_staleness: int) -> dict[str, float]:
    """Mask the tokens more than `max_staleness` versions behind `trained_version` (in place);
    return `staleness_mean` / `staleness_max` (over the trained tokens), `stale_token_fraction`
    (tokens masked by the bound, of those the loss had) and `mixed_version_fraction` (responses
    sampled by more than one version)."""
    fallback = trained_version if batch.policy_version is None else int(batch.policy_version)
    lags: list[int] = []
    masked = kept_before = mixed = 0
    for row in batch.rows:
        versions = token_versions(row.versions, len(row.response_ids), fallback)
        mixed += len(set(versions)) > 1
        mask = [1 if m else 0 for m in row.mask()]
        row_masked = 0
        for t, version in enumerate(versions):
            if not mask[t]:
                continue
            kept_before += 1
            lag = trained_version - version
            if lag > max_staleness:
                mask[t] = 0
                row_masked += 1
            else:
                lags.append(lag)
        if row_masked:
            row.loss_mask = mask
            masked += row_masked
    return {
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "staleness_max": float(max(lags, default=0)),
        "stale_token_fraction": masked / kept_before if kept_before else 0.0,
        "mixed_version_fraction": mixed / len(batch.rows) if batch.rows else 0.0,
    }
