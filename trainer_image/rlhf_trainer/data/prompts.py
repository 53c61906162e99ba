"""Prompt sources: built-in toy tasks and JSON/JSONL files.

Built-in tasks (no download, endless, example i is a pure function of (seed, i)):
  builtin://last-digit   "3714:" -> "4"      (repeat the last digit)
  builtin://sum-mod-10   "7+5=" -> "2"       ((a + b) mod 10)
  builtin://gem          the reset observations of `environment.gem` (rollout/gem_env.py)
Datasets (files or directories, see datasets.py) are read once, filtered by
`data.maxPromptLength`, and shuffled each epoch with the job seed; malformed rows are skipped
and counted (`num_skipped`, the `skipped_rows` metric), up to MAX_MALFORMED_FRACTION.
`data.maxPromptLength` applies to the built-in tasks too: example i that does not fit is
replaced by another draw seeded from (seed, i, attempt), so the stream stays a pure function
of the index, and is counted in `num_dropped`. Exempt: `builtin://gem`, whose prompts are
the environment's own opening observation (`rollout.maxTokens` bounds the trajectory).

The source's position (`state_dict`) is saved in checkpoints so a resumed run sees the same
prompts as an uninterrupted one. With partial rollouts (orchestrator/partial.py) prompts are
trained out of order: the position then also lists `pending`, the indices handed out before
it but not trained, which a resumed source hands out again first (`next_prompt`).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Callable

from .datasets import load_records
from .rendering import PromptRecord, to_prompts

if TYPE_CHECKING:
    from rlhf_contract.api.models import DataSpec

log = logging.getLogger(__name__)

MAX_BUILTIN_ATTEMPTS = 1000
"""Draws of a built-in task in a row that may all be longer than data.maxPromptLength before
the source gives up (the preflight reports such a length before any model loads)."""

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


class PromptSource:
    """Yields batches of tokenized prompts; resumable through `state_dict`."""

    def __init__(self, spec: "DataSpec", tokenizer: Any, *, seed: int, gem_id: str | None = None):
        self.tokenizer = tokenizer
        self.seed = seed
        self.spec = spec
        self.position = 0
        self.pending: list[int] = []
        """Indices below `position` handed out but not trained when the checkpoint was taken."""
        self.num_dropped = 0
        self.num_skipped = 0
        """Malformed rows skipped (files only)."""
        self._task = None
        self._rows: list[PromptRecord] = []
        path = spec.path
        self._gem_id = gem_id
        if path == "builtin://gem":
            if gem_id is None:
                raise ValueError("data.path: builtin://gem needs environment.gem (the GEM environment id)")
        elif path.startswith("builtin://"):
            name = path[len("builtin://"):]
            if name not in BUILTIN_TASKS:
                raise ValueError(f"data.path: unknown built-in task {path!r}; choose one of "
                                 + ", ".join("builtin://" + t for t in BUILTIN_TASKS))
            self._task = BUILTIN_TASKS[name]
        else:
            records = load_records(path, split=spec.split, config=spec.config)
            self._rows, self.num_dropped, self.num_skipped = to_prompts(
                records, tokenizer=tokenizer, source=path, prompt_key=spec.prompt_key, messages_key=spec.messages_key,
                answer_key=spec.answer_key, system_prompt=spec.system_prompt, max_prompt_length=spec.max_prompt_length)
            if not self._rows:
                raise ValueError(f"data.path: {path} has no usable rows ({len(records)} rows: {self.num_dropped} "
                                 f"longer than data.maxPromptLength or tokenized to nothing, {self.num_skipped} "
                                 "malformed)")
            log.info("%s: %d prompts, %d dropped (empty, or longer than data.maxPromptLength=%d), %d malformed skipped",
                     path, len(self._rows), self.num_dropped, spec.max_prompt_length, self.num_skipped)

    def _example(self, index: int) -> PromptRecord:
        if self._gem_id is not None:  # a GEM environment's first observation (rollout/gem_env.py)
            from ..rollout.gem_env import episode_seed, initial_prompt

            seed = episode_seed(self.seed, index)
            text = initial_prompt(self._gem_id, seed)
            return PromptRecord(text, self.tokenizer(text, add_special_tokens=False)["input_ids"], "",
                                {"gem_id": self._gem_id, "gem_seed": seed})
        if self._task is not None:
            return self._builtin(index)
        epoch, offset = divmod(index, len(self._rows))
        order = list(range(len(self._rows)))
        if self.spec.shuffle:
            random.Random(f"{self.seed}:epoch{epoch}").shuffle(order)
        return self._rows[order[offset]]

    def _builtin(self, index: int) -> PromptRecord:
        limit = self.spec.max_prompt_length
        for attempt in range(MAX_BUILTIN_ATTEMPTS):
            rng = random.Random(f"{self.seed}:{index}" if attempt == 0 else f"{self.seed}:{index}:{attempt}")
            text, answer = self._task(rng)
            token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if 0 < len(token_ids) <= limit:
                return PromptRecord(text, token_ids, answer, {"prompt": text, "answer": answer})
            self.num_dropped += 1
        raise ValueError(f"data.maxPromptLength: {limit} tokens is shorter than {MAX_BUILTIN_ATTEMPTS} prompts of "
                         f"{self.spec.path} in a row; raise it")

    @property
    def num_rows(self) -> int:
        """Prompts in the dataset (0 for a built-in task, which has no end)."""
        return len(self._rows)

    def next_prompt(self) -> tuple[int, PromptRecord]:
        """The next prompt and its index: a pending one first, then the one at `position`."""
        if self.pending:
            index = self.pending.pop(0)
        else:
            index, self.position = self.position, self.position + 1
        return index, self._example(index)

    def next_batch(self, n: int) -> list[PromptRecord]:
        return [self.next_prompt()[1] for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, **({"pending": list(self.pending)} if self.pending else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.pending = sorted(int(i) for i in state.get("pending", []))
