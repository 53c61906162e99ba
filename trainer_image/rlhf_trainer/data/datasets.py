"""Prompt datasets from local files through Hugging Face `datasets`, and their chat rendering.

`load_records(path, split=...)` reads, locally only (no hub):
  - a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
  - one JSON, JSONL, CSV, Parquet or Arrow file (chosen by extension);
  - a directory of such files (one format); files named after a split (`train.jsonl`,
    `test-00000.parquet`) become that split, as `datasets` infers them, otherwise all are "train".

`to_prompts(records, ...)` turns rows into `PromptRecord`s. A row's prompt is either
  - text under `prompt_key`: used as is, or rendered as [system, user] with the tokenizer's
    chat template when `system_prompt` is set;
  - chat turns under `messages_key` (or a list of turns under `prompt_key`, the verl layout):
    rendered with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`, the
    system prompt prepended when given and the turns hold none.
ColossalChat rows are accepted too: `messages` as one {role, content} dict, the answer under
`gt_answer`, `test_cases` ({"inputs": [...], "outputs": [...]}) for code.
Every column other than the prompt and `answer_key` is kept in `extra_info` under its own name
(a row's own `extra_info` column therefore arrives as `extra_info["extra_info"]`).

Simplifications: rows are read into memory (fine up to ~1e6 prompts); only string chat
content (no multimodal parts); with `system_prompt` set but no chat template, text prompts
are used as is and a warning is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
            ".arrow": "arrow"}
"""File extension -> `datasets` packaged builder."""

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
    """Every other column of the row, under its own name."""


def _load_error(path: str, what: str) -> ValueError:
    return ValueError(f"data.path: {what} ({path}); point data.path at a dataset saved with "
                      "save_to_disk, a " + "/".join(sorted(set(BUILDERS))) + " file, or a "
                      "directory of such files")


def _select_split(data: Any, split: str, path: str):
    from datasets import DatasetDict

    if isinstance(data, DatasetDict):
        if split not in data:
            raise ValueError(f"data.split: {path} has no split {split!r}; it has "
                             + ", ".join(sorted(data)))
        return data[split]
    return data


def _read(path: str, fn, *args, **kwargs):
    """Call a `datasets` reader; its errors become a ValueError naming the file."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        raise ValueError(f"data.path: could not read {path}: {type(err).__name__}: {err}") from err


def load_records(path: str, *, split: str = "train") -> list[dict]:
    """Rows of a local dataset (see the module docstring for the accepted layouts)."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise _load_error(path, "does not exist")
    if p.is_dir() and any((p / name).exists() for name in
                          ("dataset_info.json", "dataset_dict.json", "state.json")):
        data = _select_split(_read(path, datasets.load_from_disk, str(p)), split, path)
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
        builders = {BUILDERS[f.suffix] for f in files}
        if not files:
            raise _load_error(path, "the directory holds no data files")
        if len(builders) > 1:
            raise _load_error(path, "the directory mixes formats " + ", ".join(sorted(builders)))
        # `datasets` infers splits from the file names; all files are "train" otherwise.
        data = _select_split(_read(path, datasets.load_dataset, builders.pop(),
                                   data_dir=str(p)), split, path)
    elif p.suffix in BUILDERS:
        data = _read(path, datasets.load_dataset, BUILDERS[p.suffix],
                     data_files={split: str(p)}, split=split)
    else:
        raise _load_error(path, f"unknown file extension {p.suffix!r}")
    return data.to_list()


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
    value = row.get(answer_key)
    if value is None:
        value = row.get(_ANSWER_FALLBACK_KEY)
    if value is None:
        return ""
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"{where}, column {answer_key!r}: the answer must be a string or a "
                     f"number, got {type(value).__name__}")


def to_prompts(records: Iterable[dict], *, tokenizer: Any, source: str,
               prompt_key: str = "prompt", messages_key: str = "messages",
               answer_key: str = "answer", system_prompt: str | None = None,
               max_prompt_length: int) -> tuple[list[PromptRecord], int]:
    """Rows -> (prompts, number of rows dropped for being longer than `max_prompt_length` or
    for tokenizing to nothing: an empty prompt cannot be sent to a rollout server).

    `source` names the file in errors; a malformed row raises ValueError with its index.
    """
    if system_prompt is not None and not _has_chat_template(tokenizer):
        logger.warning("%s: a system prompt is set but the tokenizer has no chat template; "
                       "text prompts are used as is", source)
    prompts, num_dropped = [], 0
    for i, row in enumerate(records):
        where = f"{source}: row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a {type(row).__name__}, not an object with columns")
        if row.get(prompt_key) is not None:
            key, value = prompt_key, row[prompt_key]
        elif row.get(messages_key) is not None:
            key, value = messages_key, row[messages_key]
        else:
            raise ValueError(f"{where} has neither a {prompt_key!r} column (data.promptKey) nor a "
                             f"{messages_key!r} column (data.messagesKey)")
        where_col = f"{where}, column {key!r}"
        if isinstance(value, str):
            if system_prompt is not None and _has_chat_template(tokenizer):
                text = _render(tokenizer, [{"role": "system", "content": system_prompt},
                                           {"role": "user", "content": value}], where_col)
            else:
                text = value
        elif isinstance(value, (list, dict)):
            turns = _check_messages(value, where_col)
            if system_prompt is not None and not any(t["role"] == "system" for t in turns):
                turns = [{"role": "system", "content": system_prompt}, *turns]
            text = _render(tokenizer, turns, where_col)
        else:
            raise ValueError(f"{where_col}: expected prompt text or chat turns, got "
                             f"{type(value).__name__}")
        answer = _answer(row, answer_key, where)
        token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not token_ids or len(token_ids) > max_prompt_length:
            num_dropped += 1
            continue
        extra_info = {k: v for k, v in row.items() if k not in (key, answer_key)}
        prompts.append(PromptRecord(text, token_ids, answer, extra_info))
    return prompts, num_dropped
