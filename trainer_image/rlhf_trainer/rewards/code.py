"""Code reward: run the response's program on stdin/stdout test cases in the sandbox.

`score_code(response, test_cases)` takes the LAST fenced code block of the response
(```python ... ```, ```py ... ``` or a bare ``` ... ```), runs it once per test case with
`test_cases["inputs"][i]` on stdin, and compares its stdout to `test_cases["outputs"][i]`
after stripping trailing whitespace from every line and trailing blank lines (the usual
judge rule for competitive programming). A case passes when the program exits 0 within the
time limit and its output matches.

The reward is the FRACTION of passing cases (a dense signal for RL: a program right on 3 of 4
cases gets 0.75); `all_or_nothing=True` gives 1.0 only when every case passes, as in
pass@k evaluation. No code block, or no test cases, scores 0.0.

Where programs run: `runner` (any object with `run_many(jobs, limits, require_isolation=...)`)
is the sandbox service client (`rlhf_trainer.sandbox.SandboxClient`) on a cluster, or by
default this process's own bubblewrap sandbox (`rlhf_trainer.sandbox.run_many`). Either way the
expected outputs never leave this process: the sandbox gets the program and the input only.

`score_code_batch` scores many responses through ONE bounded queue of (response x test case)
runs, which is what the trainer's reward function uses.

Simplifications: stdin/stdout programs only (no function-call harness, no special judges,
no float tolerance); a SandboxError (the sandbox itself broken) is raised, never scored.
"""

from __future__ import annotations

import re
from typing import Any

from rlhf_trainer.sandbox import Limits, SandboxError, run_many

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(response: str) -> str | None:
    """The last fenced python (or unlabelled) code block, or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def normalize_output(text: str) -> str:
    """Trailing whitespace stripped per line and at the end."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _check_cases(test_cases: Any) -> tuple[list[str], list[str]]:
    if not isinstance(test_cases, dict):
        raise ValueError(f"test_cases must be a dict with 'inputs' and 'outputs' lists, got "
                         f"{type(test_cases).__name__}")
    inputs, outputs = test_cases.get("inputs"), test_cases.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError("test_cases needs 'inputs' and 'outputs' lists of the same length, got "
                         f"{len(inputs) if isinstance(inputs, list) else inputs!r:.50} inputs and "
                         f"{len(outputs) if isinstance(outputs, list) else outputs!r:.50} outputs")
    return [str(x) for x in inputs], [str(x) for x in outputs]


def _limits(timeout_s: float, limits: Limits | None, overrides: dict[str, Any]) -> Limits:
    base = limits or Limits()
    unknown = set(overrides) - set(Limits.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown sandbox limits {sorted(unknown)}; known: "
                        f"{sorted(Limits.__dataclass_fields__)}")
    fields = {**base.to_json(), **overrides, "timeout_s": timeout_s}
    return Limits(**fields)


def _grade(results, outputs: list[str], all_or_nothing: bool) -> float:
    passed = [r.ok and normalize_output(r.stdout) == normalize_output(expected)
              for r, expected in zip(results, outputs)]
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)


def score_code_batch(items: list[tuple[str, Any]], timeout_s: float = 10.0, *,
                     all_or_nothing: bool = False, limits: Limits | None = None,
                     require_isolation: bool = True, runner: Any = None,
                     **limit_overrides: Any) -> list[float]:
    """`score_code` for each (response, test_cases), all test cases of all responses in ONE
    call of the runner (one bounded queue). Malformed test cases raise ValueError."""
    lim = _limits(timeout_s, limits, limit_overrides)
    jobs: list[tuple[str, str]] = []
    plan: list[tuple[int, int, list[str]] | None] = []
    for response, test_cases in items:
        inputs, outputs = _check_cases(test_cases)
        code = extract_code(response)
        if code is None or not inputs:
            plan.append(None)
            continue
        plan.append((len(jobs), len(inputs), outputs))
        jobs.extend((code, x) for x in inputs)
    run = runner.run_many if runner is not None else run_many
    results = run(jobs, lim, require_isolation=require_isolation) if jobs else []
    if len(results) != len(jobs):
        raise SandboxError(f"the sandbox returned {len(results)} results for {len(jobs)} runs")
    return [0.0 if p is None else _grade(results[p[0]:p[0] + p[1]], p[2], all_or_nothing)
            for p in plan]


def score_code(response: str, test_cases: dict, timeout_s: float = 10.0, *,
               all_or_nothing: bool = False, limits: Limits | None = None,
               require_isolation: bool = True, runner: Any = None,
               **limit_overrides: Any) -> float:
    """Fraction of test cases the response's last code block passes (see the module docstring).

    `timeout_s` is per case (wall clock); `limits` / `limit_overrides` (memory_mb,
    max_processes, tmpfs_mb, max_output_bytes, cpu_s) bound each run, see `sandbox.Limits`.
    """
    return score_code_batch([(response, test_cases)], timeout_s, all_or_nothing=all_or_nothing,
                            limits=limits, require_isolation=require_isolation, runner=runner,
                            **limit_overrides)[0]
