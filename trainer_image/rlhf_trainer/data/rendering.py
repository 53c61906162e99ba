"""Dataset rows -> prompts, with the tokenizer's chat template.

`to_prompts(records, ...)` turns rows into `PromptRecord`s (`prompt_record` is one row). A
row's prompt is either
  - text under `prompt_key`: used as is, or rendered as [system, user] with the tokenizer's
    chat template when `system_prompt` is set;
  - chat turns under `messages_key` (or a list of turns under `prompt_key`, the verl layout):
    rendered with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, the
    system prompt prepended when given and the turns hold none.
ColossalChat rows are accepted too: `messages` as one {role, content} dict, the answer under
`gt_answer`, `test_cases` ({"inputs": [...], "outputs": [...]}) for code.
Every column of the row (the prompt and the answer included) is kept in `extra_info` under its
own name (a row's own `extra_info` column therefore arrives as `extra_info["extra_info"]`), and
`prompt` holds the prompt as the rewards see it: the text, or the chat turns. `prompt_key`,
`messages_key` and `answer_key` may name a nested field with dots (`reward_model.ground_truth`,
veRL's layout; `datasets.column`).
A malformed row (not an object, no prompt, a prompt of the wrong type, broken chat turns, an
answer that is neither text nor a number) is skipped and counted; more than
MAX_MALFORMED_FRACTION (datasets.py) of the rows malformed is an error naming the first one.

Simplifications: only string chat content (no multimodal parts); with `system_prompt` set
but no chat template, text prompts are used as is and a warning is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from .datasets import ROW_ERRORS, MalformedRows, UnreadableRow, column

logger = logging.getLogger(__name__)

_ANSWER_FALLBACK_KEY = "gt_answer"  # ColossalChat


@dataclass(frozen=True)
class PromptRecord:
    text: str
    """The prompt as the model sees it (chat template applied)."""
    token_ids: list[int]
    """`text` tokenized without extra special tokens."""
    answer: str
    """Gold answer for the reward ("" when the row has none, e.g. code with test cases)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """Every column of the row, under its own name."""
    prompt: str | list[dict[str, str]] | None = None
    """The prompt as a reward sees it (TRL's `prompts`): the row's text (before any chat
    template), or its chat turns (with `system_prompt` when added); None: `text`."""


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _check_messages(value: Any, where: str) -> list[dict[str, str]]:
    if isinstance(value, dict):  # ColossalChat: one turn as a dict
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list of {{role, content}} chat turns, "
                         f"got {type(value).__name__}")
    turns = []
    for j, turn in enumerate(value):
        if (not isinstance(turn, dict) or not isinstance(turn.get("role"), str)
                or not isinstance(turn.get("content"), str)):
            raise ValueError(f"{where}: turn {j} must be a dict with string 'role' and "
                             f"'content', got {turn!r:.200}")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return turns


def _render(tokenizer: Any, turns: list[dict[str, str]], where: str) -> str:
    if not _has_chat_template(tokenizer):
        raise ValueError(f"{where}: chat messages need a tokenizer with a chat template; "
                         "use a model whose tokenizer has one, or plain text prompts")
    return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)


def _answer(row: dict, answer_key: str, where: str) -> str:
    value = column(row, answer_key)
    if value is None:
        value = row.get(_ANSWER_FALLBACK_KEY)
    if value is None:
        return ""
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"{where}, column {answer_key!r}: the answer must be a string or a "
                     f"number, got {type(value).__name__}")


def prompt_record(row: Any, index: int, *, tokenizer: Any, source: str, prompt_key: str = "prompt",
                  messages_key: str = "messages", answer_key: str = "answer",
                  system_prompt: str | None = None) -> PromptRecord:
    """Row `index` of `source` as a prompt, whatever its length (`token_ids` may be empty);
    ValueError naming the file, row and column when the row is malformed."""
    where = f"{source}: row {index}"
    if isinstance(row, UnreadableRow):
        raise ValueError(f"{where}: {row}")
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, not an object with columns")
    if column(row, prompt_key) is not None:
        key, value = prompt_key, column(row, prompt_key)
    elif column(row, messages_key) is not None:
        key, value = messages_key, column(row, messages_key)
    else:
        raise ValueError(f"{where} has neither a {prompt_key!r} column (data.promptKey) nor a "
                         f"{messages_key!r} column (data.messagesKey)")
    where_col = f"{where}, column {key!r}"
    if isinstance(value, str):
        prompt: str | list[dict[str, str]] = value
        if system_prompt is not None and _has_chat_template(tokenizer):
            prompt = [{"role": "system", "content": system_prompt}, {"role": "user", "content": value}]
            text = _render(tokenizer, prompt, where_col)
        else:
            text = value
    elif isinstance(value, (list, dict)):
        prompt = _check_messages(value, where_col)
        if system_prompt is not None and not any(t["role"] == "system" for t in prompt):
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
        text = _render(tokenizer, prompt, where_col)
    else:
        raise ValueError(f"{where_col}: expected prompt text or chat turns, got "
                         f"{type(value).__name__}")
    answer = _answer(row, answer_key, where)
    token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return PromptRecord(text, token_ids, answer, dict(row), prompt)


class Prompts(NamedTuple):
    records: list[PromptRecord]
    num_dropped: int
    """Rows left out for being longer than `max_prompt_length` or tokenizing to nothing."""
    num_skipped: int
    """Malformed rows skipped."""


def to_prompts(records: Iterable[Any], *, tokenizer: Any, source: str,
               prompt_key: str = "prompt", messages_key: str = "messages",
               answer_key: str = "answer", system_prompt: str | None = None,
               max_prompt_length: int) -> Prompts:
    """Rows -> the prompts that fit in `max_prompt_length` (an empty prompt cannot be sent to
    a rollout server either); malformed rows are skipped and counted, and more than
    MAX_MALFORMED_FRACTION of them raise ValueError naming the first one's file, row and column.
    """
    if system_prompt is not None and not _has_chat_template(tokenizer):
        logger.warning("%s: a system prompt is set but the tokenizer has no chat template; "
                       "text prompts are used as is", source)
    prompts, num_dropped, num_rows, malformed = [], 0, 0, MalformedRows(source)
    for i, row in enumerate(records):
        num_rows += 1
        try:
            record = prompt_record(row, i, tokenizer=tokenizer, source=source, prompt_key=prompt_key,
                                   messages_key=messages_key, answer_key=answer_key, system_prompt=system_prompt)
        except ROW_ERRORS as err:
            malformed.skip(err)
            continue
        if not record.token_ids or len(record.token_ids) > max_prompt_length:
            num_dropped += 1
            continue
        prompts.append(record)
    malformed.check(num_rows)
    return Prompts(prompts, num_dropped, malformed.count)
