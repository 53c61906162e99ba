"""Offline rows as token sequences (`method: sft | rm | dpo`): the row formats, the
built-in toy tasks, and `Tokenize` (row -> `Example`), shared by the offline trainer
(offline/data.py) and the preflight's data checks (preflight/data.py).

Row formats (column names from `spec.data`, RL2's layouts):
  sft       `prompt` + `response` text, or `messages` (chat turns): loss on every
            assistant turn only, rendered with the tokenizer's chat template
  rm, dpo   `prompt` + `chosen` + `rejected`, or `messages` (the context) + `chosen` +
            `rejected`; a response is text, an assistant message, or a list of messages
            whose last one is the assistant's

An `Example` is one or two sequences trained together (a preference pair's chosen and
rejected are always packed into the same micro-batch). Every response ends with the
tokenizer's EOS. A malformed row (a missing or mistyped column, a conversation without an
assistant turn) raises ValueError naming the `spec.data` key.

Built-in toy tasks (no download; example i is a pure function of (seed, i)):
  builtin://last-digit   sft: "3714:" -> "4" (the RL demo's task, as supervised data)
  builtin://sum-mod-10   sft: "7+5=" -> "2"
  builtin://prefer-even  rm / dpo: "3714:" with chosen = even digits ("486"), rejected =
                         odd digits ("17"): a preference a tiny model learns in minutes

It reads no file and chooses no rows: which rows, in which order, is offline/data.py's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from rlhf_contract.api.models import DataSpec, Method

from .datasets import ROW_ERRORS, UnreadableRow, column
from .prompts import BUILTIN_TASKS

_MISSING = object()

PAIR_METHODS = tuple(m for m in Method if m.pairs)
@dataclass(frozen=True)
class Sequence:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    """Over `response_ids`: 1 where SFT's loss counts (assistant tokens)."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class Example:
    sequences: tuple[Sequence, ...]
    """SFT: (sequence,); RM and DPO: (chosen, rejected)."""


def _prefer_even(rng: random.Random) -> dict[str, str]:
    prompt = "".join(str(rng.randrange(10)) for _ in range(rng.randint(2, 5))) + ":"
    chosen = "".join(str(rng.choice((0, 2, 4, 6, 8))) for _ in range(rng.randint(1, 4)))
    rejected = "".join(str(rng.choice((1, 3, 5, 7, 9))) for _ in range(rng.randint(1, 4)))
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _sft_task(task: Callable[[random.Random], tuple[str, str]]) -> Callable[[random.Random], dict[str, str]]:
    def make(rng: random.Random) -> dict[str, str]:
        prompt, answer = task(rng)
        return {"prompt": prompt, "response": answer}
    return make


BUILTIN_OFFLINE: dict[str, tuple[str, Callable[[random.Random], dict[str, str]]]] = {
    "last-digit": ("sft", _sft_task(BUILTIN_TASKS["last-digit"])),
    "sum-mod-10": ("sft", _sft_task(BUILTIN_TASKS["sum-mod-10"])),
    "prefer-even": ("pair", _prefer_even),
}


class Tokenize:
    """Row -> Example for one method and tokenizer."""

    def __init__(self, method: str, spec: DataSpec, tokenizer: Any):
        self.method, self.spec, self.tok = method, spec, tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("model.path: the tokenizer has no EOS token; offline methods end every response with it")

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def from_row(self, row: Any, where: str) -> Example:
        """`self(row)` for the row that `where` names; ValueError naming it when the row is malformed."""
        if isinstance(row, UnreadableRow):
            raise ValueError(f"{where}: {row}")
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a {type(row).__name__}, not an object with columns")
        try:
            return self(row)
        except ROW_ERRORS as err:
            raise ValueError(f"{where}: {err}") from err

    def _chat(self, turns: list[dict], *, generation_prompt: bool) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"data.messagesKey: rows hold chat turns but the tokenizer of model.path has no chat "
                             "template; use promptKey text rows or a model with a chat template")
        return self.ids(self.tok.apply_chat_template(turns, add_generation_prompt=generation_prompt, tokenize=False))

    def _response_text(self, value: Any, where: str) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            return value["content"]
        if isinstance(value, list) and value and isinstance(value[-1], dict) and isinstance(value[-1].get("content"), str):
            return value[-1]["content"]
        raise ValueError(f"data.{where}: expected text, an assistant message or a list of messages, got {value!r:.80}")

    def _prompt(self, row: dict) -> list[int]:
        s = self.spec
        if isinstance(column(row, s.messages_key), list):
            return self._chat(column(row, s.messages_key), generation_prompt=True)
        if isinstance(column(row, s.prompt_key), str):
            return self.ids(column(row, s.prompt_key))
        raise ValueError(f"data: a row has neither text under data.promptKey ({s.prompt_key!r}) nor turns under "
                         f"data.messagesKey ({s.messages_key!r}); it has {sorted(row)}")

    def __call__(self, row: dict) -> Example:
        s, eos = self.spec, [self.tok.eos_token_id]
        if self.method in PAIR_METHODS:
            prompt = self._prompt(row)
            sides = []
            for key, where in ((s.chosen_key, "chosenKey"), (s.rejected_key, "rejectedKey")):
                value = column(row, key, _MISSING)
                if value is _MISSING:
                    raise ValueError(f"data.{where}: a row has no column {key!r}; it has {sorted(row)}")
                resp = self.ids(self._response_text(value, where)) + eos
                sides.append(Sequence(prompt, resp, [1] * len(resp)))
            return Example(tuple(sides))
        turns, response = column(row, s.messages_key), column(row, s.response_key, _MISSING)
        if isinstance(turns, list) and response is _MISSING:
            return Example((self._multi_turn(turns),))
        if response is _MISSING:
            raise ValueError(f"data.responseKey: a row has no column {s.response_key!r} (and no chat turns under "
                             f"data.messagesKey); it has {sorted(row)}")
        resp = self.ids(self._response_text(response, "responseKey")) + eos
        return Example((Sequence(self._prompt(row), resp, [1] * len(resp)),))

    def _multi_turn(self, turns: list[dict]) -> Sequence:
        """The whole conversation; 1 on the tokens of each assistant turn (the span its
        rendering adds after the generation prompt of the turns before it)."""
        full = self._chat(turns, generation_prompt=False)
        mask = [0] * len(full)
        first = None
        for i, turn in enumerate(turns):
            if turn.get("role") != "assistant":
                continue
            start = len(self._chat(turns[:i], generation_prompt=True)) if i else 0
            end = len(self._chat(turns[:i + 1], generation_prompt=False))
            mask[start:end] = [1] * (end - start)
            first = start if first is None else first
        if first is None:
            raise ValueError("data.messagesKey: a conversation has no assistant turn to train on")
        return Sequence(full[:first], full[first:], mask[first:])
