"""Prompt sources: built-in toy tasks and JSON/JSONL files.

Built-in tasks (no download, endless, example i is a pure function of (seed, i)):
  builtin://last-digit   "3714:" -> "4"      (repeat the last digit)
  builtin://sum-mod-10   "7+5=" -> "2"       ((a + b) mod 10)
Files: JSON (a list of objects) or JSONL, with the prompt under `data.promptKey` and the
answer under `data.answerKey`; shuffled each epoch with the job seed.

The source's position (`state_dict`) is saved in checkpoints so a resumed run sees the same
prompts as an uninterrupted one.

Simplification: no chat templates or other file formats yet.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

BUILTIN_TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {}


def _task(name: str):
    def register(fn):
        BUILTIN_TASKS[name] = fn
        return fn

    return register


@_task("last-digit")
def _last_digit(rng: random.Random) -> tuple[str, str]:
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(3, 6))]
    return "".join(digits) + ":", digits[-1]


@_task("sum-mod-10")
def _sum_mod_10(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"{a}+{b}=", str((a + b) % 10)


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: list[int]
    answer: str


class PromptSource:
    """Yields batches of tokenized prompts; resumable through `state_dict`."""

    def __init__(self, path: str, tokenizer: Any, *, seed: int, prompt_key: str = "prompt",
                 answer_key: str = "answer", max_prompt_length: int = 1024, shuffle: bool = True):
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_prompt_length = max_prompt_length
        self.shuffle = shuffle
        self.position = 0
        self.num_dropped = 0
        self._task = None
        self._rows: list[tuple[str, str]] = []
        if path.startswith("builtin://"):
            name = path[len("builtin://"):]
            if name not in BUILTIN_TASKS:
                raise ValueError(f"data.path: unknown built-in task {path!r}; choose one of "
                                 + ", ".join("builtin://" + t for t in BUILTIN_TASKS))
            self._task = BUILTIN_TASKS[name]
        else:
            self._rows = self._load_file(Path(path), prompt_key, answer_key)

    def _load_file(self, path: Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
        if not path.exists():
            raise ValueError(f"data.path: {path} does not exist")
        text = path.read_text()
        if path.suffix == ".json":
            records = json.loads(text)
            if not isinstance(records, list):
                raise ValueError(f"{path}: a .json data file must hold a list of objects")
        else:
            records = []
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{lineno}: not valid JSON: {err.msg}") from None
        rows = []
        for i, rec in enumerate(records):
            for key, field in ((prompt_key, "data.promptKey"), (answer_key, "data.answerKey")):
                if not isinstance(rec, dict) or key not in rec:
                    raise ValueError(f"{path}: row {i} has no column {key!r} ({field})")
            prompt = str(rec[prompt_key])
            if len(self.tokenizer(prompt)["input_ids"]) > self.max_prompt_length:
                self.num_dropped += 1
                continue
            rows.append((prompt, str(rec[answer_key])))
        if not rows:
            raise ValueError(f"{path}: no usable rows ({self.num_dropped} longer than data.maxPromptLength)")
        return rows

    def _example(self, index: int) -> tuple[str, str]:
        if self._task is not None:
            return self._task(random.Random(f"{self.seed}:{index}"))
        epoch, offset = divmod(index, len(self._rows))
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        return self._rows[order[offset]]

    def next_batch(self, n: int) -> list[Prompt]:
        batch = []
        while len(batch) < n:
            text, answer = self._example(self.position)
            self.position += 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > self.max_prompt_length:
                self.num_dropped += 1
                continue
            batch.append(Prompt(text, ids, answer))
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "num_dropped": self.num_dropped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
        self.num_dropped = int(state.get("num_dropped", 0))
