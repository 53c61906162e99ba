"""Rewards, selected by `spec.reward.type`: every reward function maps a batch of `Sample`s
(the response, the answer, the row's columns, the prompt: text or chat turns, and the
response's token ids) to (reward, score) pairs, or None ("does not apply": 0 in the trained
reward, left out of that function's `reward/<name>_mean`). `reward` feeds the advantages,
`score` is logged (RL2's split); the built-in rewards return the same number for both.

  exact_match / prefix_match   string comparison with the answer
  math                         math.score_math: final boxed / <answer> answer, math-verify, in
                               worker processes killed past `timeout_seconds` per answer
  code                         code.score_code_batch: last fenced Python block vs test_cases,
                               every (response x case) through ONE bounded sandbox queue, run
                               by the sandbox service (cluster) or bubblewrap here (local),
                               both `rlhf_trainer.sandbox`
  python                       forms.python_reward: a user function from a file or an import
                               path, ours, TRL's or veRL's form, told by its parameters
  http                         custom.RemoteReward: a reward service
  judge                        judge.Judge: an LLM judge behind an OpenAI-compatible endpoint

`reward.components` adds weighted further functions (`CombinedReward`): the trained reward
is the main reward + sum of weight x component reward, the score is the main function's,
and each function's reward is kept by name (`reward/<name>_mean` in the metrics). A function
may also count events per step (a judge: `judge_answers`, `parse_failures`, `judge_tokens`),
logged as `reward/<name>_<counter>` (`drain_counters`), and a python function may log its
own metrics (TRL's `log_metric`, averaged over the step: `reward/<name>/<metric>`,
`drain_metrics`) and columns of the samples table (TRL's `log_extra`: the `columns` given to
`score_batch`). `begin_step` hands each function the step's TRL `trainer_state`.

A response every function skipped (None) gets reward 0 and score 0. TRL instead leaves such a
completion out of its group's baseline and gives it advantage 0; here it counts as 0 in
the group (a warning says so, once).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

NAN = float("nan")  # not math.nan: this package's submodule `math` takes that name once imported

from .sample import Sample

if TYPE_CHECKING:
    from rlhf_contract.api.models import RewardSpec
    from rlhf_contract.api.reward import RewardFunctionSpec


log = logging.getLogger(__name__)

Item = Sample | tuple[str, str, dict]
"""A `Sample`, or its first three fields."""
Result = tuple[float, float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the stripped response equals the stripped answer."""
    return float(response.strip() == answer.strip())


def prefix_match(response: str, answer: str) -> float:
    """1.0 when the stripped response starts with the stripped answer."""
    return float(response.strip().startswith(answer.strip()))


class RewardFunction:
    """Scores a batch: with `batch_fn` in one call (code, math, python, http, judge), else
    item by item with `fn(response, answer, extra_info)`, in a thread pool of `workers` when
    that is above 1. `counters()` (a judge's) are drained once per step. A python function
    (`forms.PythonReward`) also takes the step's trainer state (`begin_step`), logs metrics
    (`drain_metrics`) and columns, and may be scored on several threads at once (`concurrent`)."""

    def __init__(self, fn: Callable[[str, str, dict], Result] | None = None,
                 batch_fn: Callable[[list[Sample]], list[Result | None]] | None = None, workers: int = 1,
                 counters: Callable[[], dict[str, float]] | None = None, python: Any = None):
        self._fn, self._batch_fn, self._workers, self._counters = fn, batch_fn, workers, counters
        self._python = python

    @property
    def concurrent(self) -> bool:
        """Whether batches may be scored on several threads at once (an async python function)."""
        return self._python is not None and self._python.concurrent

    def begin_step(self, trainer_state: Any) -> None:
        """The step's TRL `trainer_state`, for a python function's calls until the next one."""
        if self._python is not None:
            self._python.begin_step(trainer_state)

    def score_all(self, items: Sequence[Item], columns: dict[str, list] | None = None) -> list[Result | None]:
        """Each item's (reward, score), or None where the function does not apply. A python
        function's `log_extra` columns land in `columns` (one value per item)."""
        samples = [x if isinstance(x, Sample) else Sample(*x) for x in items]
        if self._python is not None:
            return self._python(samples, columns)
        if self._batch_fn is not None:
            return self._batch_fn(samples)
        one = lambda s: self._fn(s.response, s.answer, s.extra_info)  # noqa: E731
        if self._workers <= 1:
            return [one(s) for s in samples]
        with ThreadPoolExecutor(self._workers) as pool:
            return list(pool.map(one, samples))

    def score_batch(self, items: Sequence[Item], columns: dict[str, list] | None = None) -> list[Result]:
        """`score_all` with "does not apply" as (0, 0)."""
        results = self.score_all(items, columns)
        _warn_unscorable(sum(r is None for r in results))
        return [r if r is not None else (0.0, 0.0) for r in results]

    def drain_counters(self) -> dict[str, float]:
        """The events counted since the last call (judge: judge_answers, parse_failures, judge_tokens)."""
        return self._counters() if self._counters is not None else {}

    def drain_metrics(self) -> dict[str, float]:
        """A python function's `log_metric` values since the last call, each averaged, as
        `<name>/<metric>`."""
        return self._python.drain_metrics() if self._python is not None else {}


_warned_unscorable = False


def _warn_unscorable(count: int) -> None:
    global _warned_unscorable
    if count and not _warned_unscorable:
        _warned_unscorable = True
        log.warning("every reward function returned None for %d responses of a batch: each gets reward 0 (TRL "
                    "would leave it out of its group's baseline); make one function score every response", count)


class CombinedReward:
    """The main function and weighted components: each item's result is (total reward, main
    score, {name: that function's reward, NaN where it does not apply})."""

    def __init__(self, parts: list[tuple[str, float, RewardFunction]], main: str | None):
        self.parts, self.main = parts, main

    @property
    def concurrent(self) -> bool:
        return all(fn.concurrent for _, _, fn in self.parts)

    def begin_step(self, trainer_state: Any) -> None:
        for _, _, fn in self.parts:
            fn.begin_step(trainer_state)

    def score_batch(self, items: Sequence[Item], columns: dict[str, list] | None = None
                    ) -> list[tuple[float, float, dict[str, float]]]:
        results = {name: fn.score_all(items, columns) for name, _, fn in self.parts}
        out = []
        unscorable = 0
        for i in range(len(items)):
            own = {name: results[name][i] for name, _, _ in self.parts}
            unscorable += all(r is None for r in own.values())
            total = sum(weight * own[name][0] for name, weight, _ in self.parts if own[name] is not None)
            main = own[self.main] if self.main is not None else None
            out.append((total, main[1] if main is not None else 0.0,
                        {name: r[0] if r is not None else NAN for name, r in own.items()}))
        _warn_unscorable(unscorable if self.parts else 0)
        return out

    def drain_counters(self) -> dict[str, float]:
        """Each function's counters, as `<name>_<counter>`."""
        return {f"{name}_{k}": v for name, _, fn in self.parts for k, v in fn.drain_counters().items()}

    def drain_metrics(self) -> dict[str, float]:
        """Each python function's logged metrics, as `<name>/<metric>`."""
        return {k: v for _, _, fn in self.parts for k, v in fn.drain_metrics().items()}


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
                 sandbox_url: str | None = None, judge_url: str | None = None) -> RewardFunction | CombinedReward:
    """The reward function of `spec` (a `CombinedReward` when it has components, or is a
    judge, whose counters are logged by name). Code only: `job_name` and `namespace` are the
    job's (the trainer config's; no namespace in local mode), which name its sandbox service
    on a cluster; `sandbox_url` is a sandbox service to use instead. See `sandbox_url_for`.
    `judge_url`: the job's own judge servers (comma-separated), for a judge without `judge.url`."""
    where = dict(job_name=job_name, namespace=namespace, sandbox_url=sandbox_url, judge_url=judge_url)
    components = getattr(spec, "components", [])
    if not components and spec.type != "judge":
        return build_function(spec, name=spec.main_name, **where)
    main = None if spec.type == "model" else spec.main_name
    parts = [(main, 1.0, build_function(spec, name=main, **where))] if main is not None else []
    parts += [(c.name, c.weight, build_function(c, name=c.name, **where)) for c in components]
    return CombinedReward(parts, main)


def build_function(spec: "RewardFunctionSpec", *, name: str | None = None, job_name: str | None = None,
                   namespace: str | None = None, sandbox_url: str | None = None,
                   judge_url: str | None = None) -> RewardFunction:
    """One reward function (`reward` or one of its components), `name`d in the metrics it
    logs (default: its type). `judge_url`: the job's own judge servers, for a judge without
    `judge.url`."""
    t = spec.type
    if t == "exact_match":
        return RewardFunction(lambda r, a, e: _same(exact_match(r, a)))
    if t == "prefix_match":
        return RewardFunction(lambda r, a, e: _same(prefix_match(r, a)))
    if t == "math":
        from .math import MathScorer

        verifier = MathScorer(timeout_s=spec.timeout_seconds)
        return RewardFunction(batch_fn=lambda items: [_same(x) for x in verifier.score_many(
            [(s.response, s.answer) for s in items])])
    if t == "code":
        from rlhf_trainer.sandbox import Limits

        from .code import score_code_batch

        s = spec.sandbox
        limits = Limits(timeout_s=spec.timeout_seconds, memory_mb=s.memory_mb,
                        max_processes=s.max_processes, tmpfs_mb=s.tmpfs_mb,
                        max_output_bytes=s.max_output_kb << 10)
        runner = sandbox_runner(spec, sandbox_url, job_name=job_name, namespace=namespace)

        def code(items: list[Sample]) -> list[Result | None]:
            for i, s in enumerate(items):
                if "test_cases" not in s.extra_info:
                    raise ValueError(f"reward.type code: data row {i} of the batch has no "
                                     "test_cases column")
            scores = score_code_batch([(s.response, s.extra_info["test_cases"]) for s in items],
                                      spec.timeout_seconds, all_or_nothing=spec.all_or_nothing,
                                      limits=limits, runner=runner,
                                      require_isolation=spec.require_sandbox_isolation)
            return [_same(x) for x in scores]

        return RewardFunction(batch_fn=code)
    if t == "python":
        from .forms import python_reward

        return RewardFunction(python=python_reward(spec.file, spec.function, name=name or t,
                                                   kwargs=spec.kwargs))
    if t == "http":
        from .custom import RemoteReward

        return RewardFunction(batch_fn=RemoteReward(spec.url, timeout_s=spec.timeout_seconds).score_batch)
    if t == "judge":
        from .judge import Judge

        judge = Judge(spec.judge, timeout_s=spec.timeout_seconds, url=judge_url)
        return RewardFunction(batch_fn=judge.score_batch, counters=judge.drain_counters)
    if t == "model":  # scored by the reward model in the trainer processes (rl/reward_model.py)
        return RewardFunction(lambda r, a, e: _same(0.0))
    raise ValueError(f"reward.type: unknown reward {t!r}")
