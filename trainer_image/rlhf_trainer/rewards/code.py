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

Simplifications: stdin/stdout programs only (no function-call harness, no special judges,
no float tolerance); the cases of one response run in parallel up to `max_workers`; a
SandboxError (the sandbox itself broken) is raised, never scored.
"""

from __future__ import annotations

import re
from typing import Any

from rlhf_trainer.rewards.sandbox import run_many

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


def score_code(response: str, test_cases: dict, timeout_s: float = 10.0, *,
               all_or_nothing: bool = False, max_workers: int | None = None,
               **sandbox_kwargs: Any) -> float:
    """Fraction of test cases the response's last code block passes (see the module docstring).

    `timeout_s` is per case (wall clock); `sandbox_kwargs` go to `sandbox.run_python`
    (memory_mb, max_processes, require_isolation, ...).
    """
    inputs, outputs = _check_cases(test_cases)
    code = extract_code(response)
    if code is None or not inputs:
        return 0.0
    results = run_many([(code, x) for x in inputs], max_workers=max_workers,
                       timeout_s=timeout_s, **sandbox_kwargs)
    passed = [r.ok and normalize_output(r.stdout) == normalize_output(expected)
              for r, expected in zip(results, outputs)]
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)
