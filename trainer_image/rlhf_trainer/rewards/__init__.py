"""Rewards, selected by `spec.reward.type`: every reward function maps a batch of
(response, answer, extra_info) to (reward, score) pairs. `reward` feeds the advantages,
`score` is logged (RL2's split); the built-in rewards return the same number for both.

  exact_match / prefix_match   string comparison with the answer
  math                         math.score_math: final boxed / <answer> answer, math-verify, in
                               worker processes killed past `timeout_seconds` per answer
  code                         code.score_code_batch: last fenced Python block vs test_cases,
                               every (response x case) through ONE bounded sandbox queue, run
                               by the sandbox service (cluster) or bubblewrap here (local),
                               both `rlhf_trainer.sandbox`
  python                       custom.load_reward_function: a user file's function
  http                         custom.RemoteReward: a reward service

`reward.components` adds weighted further functions (`CombinedReward`): the trained reward
is the main reward + sum of weight x component reward, the score is the main function's,
and each function's reward is kept by name (`reward/<name>_mean` in the metrics).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rlhf_contract.api.models import RewardSpec
    from rlhf_contract.api.task import RewardFunctionSpec

Item = tuple[str, str, dict]
Result = tuple[float, float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    return float(response.strip() == answer.strip())


def prefix_match(response: str, answer: str) -> float:
    """1.0 when the stripped response starts with the stripped answer."""
    return float(response.strip().startswith(answer.strip()))


class RewardFunction:
    """Scores a batch: with `batch_fn` in one call (code, math, http), else item by item with
    `fn`, in a thread pool of `workers` when that is above 1."""

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


class CombinedReward:
    """The main function and weighted components: each item's result is (total reward, main
    score, {name: that function's reward})."""

    def __init__(self, parts: list[tuple[str, float, RewardFunction]], main: str | None):
        self.parts, self.main = parts, main

    def score_batch(self, items: list[Item]) -> list[tuple[float, float, dict[str, float]]]:
        results = {name: fn.score_batch(items) for name, _, fn in self.parts}
        out = []
        for i in range(len(items)):
            total = sum(weight * results[name][i][0] for name, weight, _ in self.parts)
            score = results[self.main][i][1] if self.main is not None else 0.0
            out.append((total, score, {name: results[name][i][0] for name, _, _ in self.parts}))
        return out


def _same(value: float) -> Result:
    return value, value


def sandbox_url_for(spec: "RewardFunctionSpec", sandbox_url: str | None = None, *,
                    job_name: str | None = None, namespace: str | None = None) -> str | None:
    """Where model code runs, first that applies: `sandbox_url`, `reward.sandbox.url`,
    `$RLHF_SANDBOX_URL`, and in a Kubernetes pod (`$KUBERNETES_SERVICE_HOST` set) of a job with
    a `namespace` the `<job_name>-sandbox` service the operator creates for every code-reward
    job. None: this process runs programs itself, with bubblewrap (local mode, which has no
    namespace)."""
    from rlhf_contract.sandbox import ENV_SANDBOX_URL
    from rlhf_contract.sandbox import sandbox_url as service_url

    if sandbox_url or spec.sandbox.url or os.environ.get(ENV_SANDBOX_URL):
        return sandbox_url or spec.sandbox.url or os.environ[ENV_SANDBOX_URL]
    if namespace is not None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        if not job_name:
            raise ValueError(f"the sandbox service of a job in namespace {namespace!r} needs the "
                             "job's name: pass job_name (the trainer config's job_name)")
        return service_url(job_name, namespace)
    return None


def sandbox_runner(spec: "RewardFunctionSpec", sandbox_url: str | None = None, *,
                   job_name: str | None = None, namespace: str | None = None):
    """The sandbox service client for `sandbox_url_for(...)`, or None (run here)."""
    url = sandbox_url_for(spec, sandbox_url, job_name=job_name, namespace=namespace)
    if not url:
        return None
    from rlhf_trainer.sandbox import SandboxClient

    return SandboxClient(url)


def build_reward(spec: "RewardSpec", *, job_name: str | None = None, namespace: str | None = None,
                 sandbox_url: str | None = None) -> RewardFunction | CombinedReward:
    """The reward function of `spec` (a `CombinedReward` when it has components). Code only:
    `job_name` and `namespace` are the job's (the trainer config's; no namespace in local
    mode), which name its sandbox service on a cluster; `sandbox_url` is a sandbox service
    to use instead. See `sandbox_url_for`."""
    components = getattr(spec, "components", [])
    if not components:
        return build_function(spec, job_name=job_name, namespace=namespace, sandbox_url=sandbox_url)
    main = None if spec.type == "model" else spec.main_name
    parts = [(main, 1.0, build_function(spec, job_name=job_name, namespace=namespace, sandbox_url=sandbox_url))] \
        if main is not None else []
    parts += [(c.name, c.weight, build_function(c, job_name=job_name, namespace=namespace, sandbox_url=sandbox_url))
              for c in components]
    return CombinedReward(parts, main)


def build_function(spec: "RewardFunctionSpec", *, job_name: str | None = None, namespace: str | None = None,
                   sandbox_url: str | None = None) -> RewardFunction:
    """One reward function (`reward` or one of its components)."""
    t = spec.type
    if t == "exact_match":
        return RewardFunction(lambda r, a, e: _same(exact_match(r, a)))
    if t == "prefix_match":
        return RewardFunction(lambda r, a, e: _same(prefix_match(r, a)))
    if t == "math":
        from .math import MathScorer

        verifier = MathScorer(timeout_s=spec.timeout_seconds)
        return RewardFunction(batch_fn=lambda items: [_same(x) for x in verifier.score_many(
            [(r, a) for r, a, _ in items])])
    if t == "code":
        from rlhf_trainer.sandbox import Limits

        from .code import score_code_batch

        s = spec.sandbox
        limits = Limits(timeout_s=spec.timeout_seconds, memory_mb=s.memory_mb,
                        max_processes=s.max_processes, tmpfs_mb=s.tmpfs_mb,
                        max_output_bytes=s.max_output_kb << 10)
        runner = sandbox_runner(spec, sandbox_url, job_name=job_name, namespace=namespace)

        def code(items: list[Item]) -> list[Result]:
            for i, (_, _, extra) in enumerate(items):
                if "test_cases" not in extra:
                    raise ValueError(f"reward.type code: data row {i} of the batch has no "
                                     "test_cases column")
            scores = score_code_batch([(r, e["test_cases"]) for r, _, e in items],
                                      spec.timeout_seconds, all_or_nothing=spec.all_or_nothing,
                                      limits=limits, runner=runner,
                                      require_isolation=spec.require_sandbox_isolation)
            return [_same(x) for x in scores]

        return RewardFunction(batch_fn=code)
    if t == "python":
        from .custom import load_reward_function

        return RewardFunction(load_reward_function(spec.file, spec.function))
    if t == "http":
        from .custom import RemoteReward

        return RewardFunction(batch_fn=RemoteReward(spec.url, timeout_s=spec.timeout_seconds).score_batch)
    if t == "model":  # scored by the reward model in the trainer processes (rl/reward_model.py)
        return RewardFunction(lambda r, a, e: _same(0.0))
    raise ValueError(f"reward.type: unknown reward {t!r}")
