"""Rewards, selected by `spec.reward.type`: every scorer maps a batch of
(response, answer, extra_info) to (reward, score) pairs. `reward` feeds the advantages,
`score` is logged (RL2's split); the built-in rewards return the same number for both.

  exact_match / prefix_match   string comparison with the answer
  math                         math.score_math: final boxed / <answer> answer, math-verify
  code                         code.score_code: last fenced Python block vs test_cases, sandboxed
  python                       custom.load_reward_function: a user file's function
  http                         custom.RemoteReward: a reward service
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rlhf_contract.api.models import RewardSpec

Item = tuple[str, str, dict]
Result = tuple[float, float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    return float(response.strip() == answer.strip())


def prefix_match(response: str, answer: str) -> float:
    """1.0 when the stripped response starts with the stripped answer."""
    return float(response.strip().startswith(answer.strip()))


class Scorer:
    """Scores a batch; per-item functions run in a thread pool (code rewards wait on
    sandbox processes, so threads overlap them)."""

    def __init__(self, fn: Callable[[str, str, dict], Result] | None = None,
                 batch_fn: Callable[[list[Item]], list[Result]] | None = None, workers: int = 1):
        self._fn, self._batch_fn, self._workers = fn, batch_fn, workers

    def score_batch(self, items: list[Item]) -> list[Result]:
        if self._batch_fn is not None:
            return self._batch_fn(items)
        if self._workers <= 1:
            return [self._fn(*item) for item in items]
        with ThreadPoolExecutor(self._workers) as pool:
            return list(pool.map(lambda item: self._fn(*item), items))


def _same(value: float) -> Result:
    return value, value


def build_scorer(spec: "RewardSpec") -> Scorer:
    t = spec.type
    if t == "exact_match":
        return Scorer(lambda r, a, e: _same(exact_match(r, a)))
    if t == "prefix_match":
        return Scorer(lambda r, a, e: _same(prefix_match(r, a)))
    if t == "math":
        from .math import score_math

        return Scorer(lambda r, a, e: _same(score_math(r, a)), workers=4)
    if t == "code":
        from .code import score_code

        def code(r: str, a: str, e: dict) -> Result:
            if "test_cases" not in e:
                raise ValueError("reward.type code: a data row has no test_cases column")
            return _same(score_code(r, e["test_cases"], spec.timeout_seconds, all_or_nothing=spec.all_or_nothing,
                                    require_isolation=spec.require_sandbox_isolation))

        return Scorer(code, workers=max(2, os.cpu_count() or 2))
    if t == "python":
        from .custom import load_reward_function

        return Scorer(load_reward_function(spec.file, spec.function))
    if t == "http":
        from .custom import RemoteReward

        return Scorer(batch_fn=RemoteReward(spec.url, timeout_s=spec.timeout_seconds).score_batch)
    raise ValueError(f"reward.type: unknown reward {t!r}")
