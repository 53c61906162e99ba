"""Math reward: the response's final answer checked against the gold answer with math-verify.

`score_math(response, answer)` returns 1.0 when the final answer in `response` is
mathematically equal to `answer` (`\\frac{1}{2}` == `0.5` == `1/2`, `2\\sqrt{2}` == `\\sqrt{8}`,
`x = 3` == `3`, sets and intervals as math-verify supports), else 0.0.

The final answer is:
  1. R1 style: the content of the `<answer>...</answer>` block that follows `</think>`
     (the opening `<think>` may be in the prompt); a `\\boxed{}` inside it is unwrapped.
  2. Otherwise the LAST `\\boxed{...}` (or `\\fbox{...}`) in the response, nested braces handled.
  3. Otherwise none: 0.0. Bare text such as "The answer is 5" is not graded.

Departures and simplifications:
- In R1 format the `<answer>` block wins over a `\\boxed{}` inside the thinking, because the
  block is the model's declared final answer.
- Both strings are wrapped in `\\boxed{...}` before `math_verify.parse`, so answers written
  without `$` delimiters parse; `verify(gold, prediction)` is called gold first (it is
  not symmetric).
- math-verify's timeouts use `signal.alarm`, which only works in the main thread. There we
  keep them; in any other thread they are switched off and the extracted answer is capped
  at `MAX_ANSWER_CHARS` instead, which bounds but does not eliminate a slow sympy case.
- Any exception inside math-verify scores 0.0 (it is logged at debug level).
"""

from __future__ import annotations

import logging
import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers (or gold answers) score 0.0 without being parsed."""

TIMEOUT_S = 5
"""math-verify's own per-parse and per-comparison timeout (main thread only)."""

_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` whose braces close, else None."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_final_answer(response: str) -> str | None:
    """The final answer of a response (see the module docstring), stripped, or None."""
    think_end = response.rfind("</think>")
    if think_end >= 0:
        tagged = _ANSWER_TAG.findall(response, think_end)
        if tagged:
            content = tagged[-1]
            boxed = last_boxed(content)
            content = boxed if boxed is not None else content
            return content.strip() or None
    boxed = last_boxed(response)
    return boxed.strip() if boxed is not None and boxed.strip() else None


def _parse(expr: str, timeout: int | None):
    return parse("\\boxed{" + expr + "}", _EXTRACTION, parsing_timeout=timeout)


def score_math(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` by math-verify, else 0.0.

    Safe to call from any thread; never raises.
    """
    prediction = extract_final_answer(response)
    gold = answer.strip()
    if prediction is None or not gold:
        return 0.0
    if len(prediction) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return 0.0
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold_parsed = _parse(gold, timeout)
        pred_parsed = _parse(prediction, timeout)
        if not gold_parsed or not pred_parsed:
            return 0.0
        return float(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify or sympy failing on odd input is a wrong answer
        logger.debug("math-verify failed on gold %r, prediction %r", gold, prediction,
                     exc_info=True)
        return 0.0
