"""Examples for the offline methods, from built-in toy tasks or local datasets (the
layouts of `data/datasets.py`: JSON, JSONL, CSV, Parquet, Arrow, `save_to_disk`); what a
row becomes (formats, built-in tasks, `Example`) is data/examples.py's.

Examples longer than the micro-batch budget allows (the whole sequence for SFT, each side
of a pair for RM and DPO: budget / 2) are dropped and counted (`num_dropped`); malformed
rows are skipped and counted (`num_skipped`, the `skipped_rows` metric), up to
MAX_MALFORMED_FRACTION of the rows (data/datasets.py).

Held-out examples (`evaluation.heldOutFraction`): the last fraction of a shuffled dataset;
for a built-in task, examples from a disjoint index range (200 of them, or the fraction
x 1000).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from rlhf_contract.api.models import DataSpec

from ..data.datasets import MalformedRows, load_records
from ..data.examples import BUILTIN_OFFLINE, PAIR_METHODS, Example, Tokenize

__all__ = ["EVAL_OFFSET", "Example", "OfflineData"]  # Example: what a batch holds (offline/step.py)

log = logging.getLogger(__name__)

EVAL_OFFSET = 10**9
"""Built-in tasks: held-out examples are indices EVAL_OFFSET, EVAL_OFFSET + 1, ..."""


class OfflineData:
    """Train and held-out examples; `batch(step)` is a pure function of the step (resume
    needs no data state)."""

    def __init__(self, method: str, spec: DataSpec, tokenizer: Any, *, seed: int, batch_size: int, budget: int,
                 held_out_fraction: float = 0.0):
        self.method, self.seed, self.batch_size = method, seed, batch_size
        self.limit = budget // 2 if method in PAIR_METHODS else budget
        self.num_dropped = self.num_skipped = 0
        tokenize = Tokenize(method, spec, tokenizer)
        self._task = None
        if spec.path.startswith("builtin://"):
            name = spec.path[len("builtin://"):]
            kind, make = BUILTIN_OFFLINE.get(name, (None, None))
            want = "pair" if method in PAIR_METHODS else "sft"
            if kind != want:
                choices = [f"builtin://{n}" for n, (k, _) in BUILTIN_OFFLINE.items() if k == want]
                raise ValueError(f"data.path: {spec.path!r} is not a built-in {method} task; choose one of "
                                 + ", ".join(choices))
            self._task = lambda i: tokenize(make(random.Random(f"{seed}:{i}")))
            n_eval = max(1, round(held_out_fraction * 1000)) if held_out_fraction else 200
            self.eval = [self._task(EVAL_OFFSET + i) for i in range(n_eval)]
            self.train: list[Example] = []
        else:
            rows = load_records(spec.path, split=spec.split, config=spec.config)
            examples = [e for e in self._examples(rows, tokenize, spec.path) if self._fits(e)]
            if not examples:
                raise ValueError(f"data.path: {spec.path} has no usable rows ({len(rows)} rows: {self.num_dropped} "
                                 f"longer than the micro-batch budget allows, {self.num_skipped} malformed)")
            order = list(range(len(examples)))
            random.Random(f"{seed}:split").shuffle(order)
            n_eval = int(len(examples) * held_out_fraction)
            self.eval = [examples[i] for i in order[len(order) - n_eval:]] if n_eval else []
            self.train = [examples[i] for i in order[:len(order) - n_eval]]
            self.shuffle = spec.shuffle
            log.info("%s: %d train / %d held-out examples, %d dropped (longer than the budget), %d malformed skipped",
                     spec.path, len(self.train), len(self.eval), self.num_dropped, self.num_skipped)

    def _examples(self, rows: list, tokenize: Tokenize, source: str) -> list[Example]:
        """The rows' examples; malformed rows are skipped and counted."""
        malformed, examples = MalformedRows(source), []
        for i, row in enumerate(rows):
            try:
                examples.append(tokenize.from_row(row, f"{source}: row {i}"))
            except ValueError as err:
                malformed.skip(err)
        malformed.check(len(rows))
        self.num_skipped = malformed.count
        return examples

    def _fits(self, example: Example) -> bool:
        if all(seq.length <= self.limit for seq in example.sequences):
            return True
        self.num_dropped += 1
        return False

    def _example(self, index: int) -> Example:
        if self._task is not None:
            while True:  # built-in examples are short; skip (deterministically) any that do not fit
                example = self._task(index)
                if self._fits(example):
                    return example
                index += EVAL_OFFSET // 2
        epoch, offset = divmod(index, len(self.train))
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._order = epoch, list(range(len(self.train)))
            if self.shuffle:
                random.Random(f"{self.seed}:epoch{epoch}").shuffle(self._order)
        return self.train[self._order[offset]]

    def batch(self, step: int) -> list[Example]:
        """The examples of 1-based `step`."""
        start = (step - 1) * self.batch_size
        return [self._example(i) for i in range(start, start + self.batch_size)]
