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
- Parsing and comparison run in worker processes (`MathScorer`), never in the caller: an
  answer such as `9^{9^{9^{9}}}` makes sympy compute a number of 370 million digits in C,
  which no signal interrupts. Each answer has `timeout_s`; past it the worker is SIGKILLed
  (and replaced) and the answer scores 0.0. Inside a worker math-verify's own `signal.alarm`
  timeouts work too (it is the worker's main thread), and its address space is capped at
  `WORKER_MEMORY_MB`. So scoring is safe from any thread and never stalls the step.
- Any exception inside math-verify scores 0.0 (it is logged at debug level).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import re
import resource
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers (or gold answers) score 0.0 without being parsed."""

TIMEOUT_S = 5.0
"""Default time limit per answer (parse + compare), after which the answer scores 0.0."""
WORKER_MEMORY_MB = 4096
"""Address-space limit of each worker process."""
WORKER_START_TIMEOUT_S = 300.0
"""How long a worker may take to import math-verify and sympy (a loaded machine)."""
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


def _verify(gold: str, prediction: str, timeout: int) -> float:
    """In a worker: math-verify on the two answers, 0.0 on any failure."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    try:
        gold_parsed = parse("\\boxed{" + gold + "}", extraction, parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + prediction + "}", extraction, parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return 0.0
        return float(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify or sympy failing on odd input is a wrong answer
        logger.debug("math-verify failed on gold %r, prediction %r", gold, prediction,
                     exc_info=True)
        return 0.0


def _worker_main() -> None:
    """`python -m rlhf_trainer.rewards.math --worker`: JSON lines [gold, prediction, timeout]
    on stdin, one score per line on stdout; exits at EOF or when its parent dies."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_MB << 20, WORKER_MEMORY_MB << 20))
    out = os.fdopen(os.dup(1), "w")  # results only; stray prints of libraries go to stderr
    os.dup2(2, 1)
    import math_verify  # noqa: F401  (import before saying ready: it takes seconds)

    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        gold, prediction, timeout = json.loads(line)
        out.write(f"{_verify(gold, prediction, max(1, int(timeout)))}\n")
        out.flush()


_spawn_requests: queue.Queue = queue.Queue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawn(argv: list[str], **kwargs) -> subprocess.Popen:
    """Popen from ONE long-lived thread: a worker's PR_SET_PDEATHSIG fires when the THREAD
    that forked it exits, so workers must not be started from short-lived pool threads."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            def loop() -> None:
                while True:
                    args, kw, box, done = _spawn_requests.get()
                    try:
                        box.append(subprocess.Popen(args, **kw))
                    except BaseException as err:  # handed to the caller
                        box.append(err)
                    done.set()
            _spawner = threading.Thread(target=loop, name="math-worker-spawner", daemon=True)
            _spawner.start()
    box: list = []
    done = threading.Event()
    _spawn_requests.put((argv, kwargs, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class _Worker:
    def __init__(self) -> None:
        self.proc = _spawn(
            [sys.executable, "-m", "rlhf_trainer.rewards.math", "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        self._buffer = b""
        if self._readline(WORKER_START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError(f"the math reward worker did not start within "
                               f"{WORKER_START_TIMEOUT_S} s (python {sys.executable})")

    def _readline(self, timeout: float) -> str | None:
        """The next line from the worker within `timeout`, or None (timeout or EOF)."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()

    def score(self, gold: str, prediction: str, timeout_s: float) -> float | None:
        """The score, or None when the worker ran past `timeout_s` or died (then it is dead)."""
        try:
            self.proc.stdin.write((json.dumps([gold, prediction, timeout_s]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        line = self._readline(timeout_s)
        if line is None:
            self.kill()
            return None
        return float(line)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class MathScorer:
    """Scores answers in `workers` worker processes, each answer within `timeout_s` (see the
    module docstring). Thread-safe; workers start on first use and are replaced when killed."""

    def __init__(self, timeout_s: float = TIMEOUT_S, workers: int | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"reward.timeoutSeconds must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self.workers = workers or max(1, min(4, len(os.sched_getaffinity(0))))
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(self.workers):
            self._idle.put(None)  # a slot; its worker starts when first needed
        self._all: list[_Worker] = []
        atexit.register(self.close)

    def _score_pair(self, gold: str, prediction: str) -> float:
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive:
                worker = _Worker()
                self._all.append(worker)
            result = worker.score(gold, prediction, self.timeout_s)
            if result is None:
                logger.info("math answer %.80r took over %s s: scored 0", prediction,
                            self.timeout_s)
                worker = None
            return result or 0.0
        finally:
            self._idle.put(worker)

    def score(self, response: str, answer: str) -> float:
        return self.score_many([(response, answer)])[0]

    def score_many(self, pairs: list[tuple[str, str]]) -> list[float]:
        """1.0 / 0.0 for each (response, gold answer), in order."""
        todo: list[tuple[int, str, str]] = []
        scores = [0.0] * len(pairs)
        for i, (response, answer) in enumerate(pairs):
            prediction, gold = extract_final_answer(response), answer.strip()
            if prediction is None or not gold:
                continue
            if len(prediction) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
                continue
            todo.append((i, gold, prediction))
        if len(todo) <= 1:
            for i, gold, prediction in todo:
                scores[i] = self._score_pair(gold, prediction)
            return scores
        with ThreadPoolExecutor(min(len(todo), self.workers)) as pool:
            for (i, _, _), value in zip(todo, pool.map(lambda t: self._score_pair(t[1], t[2]),
                                                       todo)):
                scores[i] = value
        return scores

    def close(self) -> None:
        for worker in self._all:
            if worker.alive:
                worker.kill()
        self._all.clear()


_default: MathScorer | None = None
_default_lock = threading.Lock()


def score_math(response: str, answer: str, timeout_s: float = TIMEOUT_S) -> float:
    """1.0 when the response's final answer equals `answer` by math-verify, else 0.0, within
    `timeout_s` (a shared `MathScorer`). Safe to call from any thread; never raises."""
    global _default
    with _default_lock:
        if _default is None or _default.timeout_s != timeout_s:
            _default = MathScorer(timeout_s)
        scorer = _default
    return scorer.score(response, answer)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
