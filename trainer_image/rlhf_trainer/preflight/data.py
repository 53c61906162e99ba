"""The preflight's data checks: what only the data can tell, found before any model loads.

`check_data(config, tokenizer)` opens each dataset of a trainer config (`data.path`; for RL
also every `evaluation.datasets` entry, read with `data`'s keys) as the trainer will (the
same layouts, split and columns: `peek_records` in data/datasets.py), but reads only its columns,
the first SAMPLE_ROWS rows and, where the format gives it cheaply, its row count, so a
large Parquet or Arrow dataset does not delay the start. Each problem names the spec field
and what to change:
  - the path missing, unreadable, without the split, or without rows;
  - RL: neither the prompt nor the messages column (the columns found are listed); for
    reward.type `code` no `test_cases`, for `math`, `exact_match` and `prefix_match` no
    answer (data.answerKey or `gt_answer`), unless an environment gives the rewards;
  - offline: no prompt or chat turns; `sft` without a response column or chat turns; `rm`
    and `dpo` without the chosen or the rejected column;
  - the sampled rows through the trainer's own row code (`prompt_record` in data/rendering.py,
    offline `Tokenize`): more than half of them malformed is an error (when the sample is
    the whole dataset: more than MAX_MALFORMED_FRACTION, the trainer's own limit), fewer a
    warning;
  - every sampled prompt longer than data.maxPromptLength (offline: every example longer
    than the micro-batch budget allows) or tokenizing to nothing is an error; most of them
    a warning with the fraction and a length that keeps 95% of them. Built-in tasks are
    sampled (BUILTIN_SAMPLE prompts) the same way.
A column counts as present when a sampled row holds a value in it; a key with dots names a
nested field (`reward_model.ground_truth`) as the trainer reads it (`datasets.column`). `tokenizer()` is called
only when a length must be measured (the model's tokenizer: no weights); None skips the row
and length checks (`unchecked` says so).

Not checked: `builtin://gem` (its prompts are the environment's and exempt from
data.maxPromptLength); rows after the sample (the trainer skips malformed ones and counts
them in `skipped_rows`).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhf_contract.api.models import DataSpec, Method
from rlhf_contract.api.uris import hub_id_hint
from rlhf_contract.trainer_config import TrainerConfig

from ..data.datasets import MAX_MALFORMED_FRACTION, ROW_ERRORS, DataSample, column, peek_records
from ..data.examples import BUILTIN_OFFLINE, PAIR_METHODS, Tokenize
from ..data.prompts import BUILTIN_TASKS, PromptSource
from ..data.rendering import prompt_record

SAMPLE_ROWS = 256
"""Rows read from the start of a dataset."""
BUILTIN_SAMPLE = 64
"""Prompts (or offline examples) drawn from a built-in task."""
KEEP_FRACTION = 0.95
"""A suggested length keeps this fraction of the sampled prompts."""
ANSWER_REWARDS = ("math", "exact_match", "prefix_match")
"""Reward types that compare the response with the row's answer."""


@dataclass
class DataReport:
    problems: list[str] = field(default_factory=list)
    """Each ends the job (exit 2), naming the field and what to change."""
    warnings: list[str] = field(default_factory=list)
    """Worth knowing; the job runs."""
    unchecked: list[str] = field(default_factory=list)
    """What could not be checked here (a path not on this machine, no tokenizer)."""


@dataclass(frozen=True)
class _Set:
    """One dataset to check."""

    spec: DataSpec
    """How it is read (an evaluation set: `data`'s keys with its own path and split)."""
    field: str
    """The spec field of its path and split, without `.path`."""
    label: str
    """How messages name it."""


def load_tokenizer(model_path: str) -> Any:
    """The model's tokenizer as the trainer loads it (AutoTokenizer: no weights); ValueError
    naming spec.model.path when it cannot be loaded."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as err:  # transformers raises many kinds
        raise ValueError(f"spec.model.path: cannot load the tokenizer of {model_path} ({type(err).__name__}: "
                         f"{err}); the trainer loads it with AutoTokenizer.from_pretrained") from err


def _sets(config: TrainerConfig) -> list[_Set]:
    sets = [_Set(config.data, "spec.data", config.data.path)]
    evaluation = config.evaluation if not config.method.offline else None
    for d in getattr(evaluation, "datasets", None) or []:
        spec = DataSpec(**{**config.data.model_dump(), "path": d.path, "config": d.config, "split": d.split, "shuffle": False})
        sets.append(_Set(spec, f"spec.evaluation.datasets[{d.name}]", f"evaluation dataset {d.name!r} ({d.path})"))
    return sets


def check_data(config: TrainerConfig, tokenizer: Callable[[], Any], *, require_paths: bool = True) -> DataReport:
    """The data problems of `config`. `tokenizer()` returns the model's tokenizer, None (the
    lengths are not checked) or raises ValueError (a problem). `require_paths=False` (rlhfctl
    validate): a dataset path not on this machine is noted in `unchecked`, not a problem."""
    report, loaded = DataReport(), []

    def tok() -> Any:
        if not loaded:
            try:
                loaded.append(tokenizer())
            except ValueError as err:
                loaded.append(None)
                report.problems.append(str(err))
        return loaded[0]

    for s in _sets(config):
        if s.spec.path.startswith("builtin://"):
            _check_builtin(config, s, tok, report)
        elif Path(s.spec.path).exists():
            _check_file(config, s, tok, report)
        elif require_paths:
            report.problems.append(f"{s.field}.path: " + (hub_id_hint(s.spec.path) or f"{s.spec.path} does not "
                                                          "exist in the trainer (mount the volume that holds it)"))
        else:
            hint = hub_id_hint(s.spec.path)
            if hint:
                report.problems.append(f"{s.field}.path: {hint}")
            else:
                report.unchecked.append(f"{s.field}.path: {s.spec.path} is not on this machine; its data were not "
                                        "checked")
    return report


def _in_field(message: str, s: _Set) -> str:
    """A load error ("data.path: ...", "data.split: ...") under the set's own field."""
    return f"{s.field}.{message[len('data.'):]}" if message.startswith("data.") else f"spec.{message}"


def _check_file(config: TrainerConfig, s: _Set, tokenizer: Callable[[], Any], report: DataReport) -> None:
    d = s.spec
    try:
        sample = peek_records(d.path, split=d.split, config=d.config, limit=SAMPLE_ROWS)
    except ValueError as err:
        report.problems.append(_in_field(str(err), s))
        return
    if not sample.rows:
        where = f" in split {d.split!r}" if Path(d.path).is_dir() else ""
        report.problems.append(f"{s.field}.path: {s.label} has no rows{where}; point it at a dataset with rows")
        return
    missing = _missing_columns(config, s, sample)
    if missing:
        report.problems += missing
        return
    tok = tokenizer()
    if tok is None:
        report.unchecked.append(f"{s.label}: rows and prompt lengths not checked (no tokenizer)")
        return
    try:
        lengths, errors = (_prompt_lengths(sample.rows, d, tok) if not config.method.offline
                           else _example_lengths(config, sample.rows, d, tok))
    except ValueError as err:  # a tokenizer that cannot serve the method at all (no EOS)
        report.problems.append(_in_field(str(err), s))
        return
    _judge_malformed(errors, len(sample.rows), sample.num_rows == len(sample.rows), s, report)
    _judge_lengths(config, lengths, s, report)


def _missing_columns(config: TrainerConfig, s: _Set, sample: DataSample) -> list[str]:
    d, label = s.spec, s.label
    rows = [row for row in sample.rows if isinstance(row, dict)]
    keys = (d.prompt_key, d.messages_key, d.answer_key, d.response_key, d.chosen_key, d.rejected_key,
            "test_cases", "gt_answer")
    present = {key for key in keys if any(column(row, key) is not None for row in rows)}  # dotted keys: nested
    found = f"its columns are {', '.join(sample.columns)}" if sample.columns else "it has no columns"
    problems = []
    if d.prompt_key not in present and d.messages_key not in present:
        problems.append(f"spec.data.promptKey: {label} has neither a {d.prompt_key!r} column (data.promptKey) nor a "
                        f"{d.messages_key!r} column (data.messagesKey); {found}: set data.promptKey (or "
                        "data.messagesKey) to the column that holds the prompt")
    if config.method == Method.SFT and d.response_key not in present and d.messages_key not in present:
        problems.append(f"spec.data.responseKey: method sft trains on a {d.response_key!r} column (data.responseKey) "
                        f"or on chat turns under {d.messages_key!r} (data.messagesKey), but {label} has neither; "
                        f"{found}: set data.responseKey to the column that holds the response")
    for key, name in ((d.chosen_key, "chosenKey"), (d.rejected_key, "rejectedKey")):
        if config.method in PAIR_METHODS and key not in present:
            problems.append(f"spec.data.{name}: method {config.method} needs a {key!r} column (data.{name}) in every "
                            f"row, but {label} has none; {found}: set data.{name} to its column")
    rewards = [("reward.type", config.reward.type)] + [
        (f"reward.components[{i}].type", c.type) for i, c in enumerate(config.reward.components)]
    for field, reward in rewards if not config.method.offline and config.environment is None else ():
        if reward == "code" and "test_cases" not in present:
            problems.append(f"spec.{field}: code runs each response against the row's 'test_cases' "
                            f"({{inputs, outputs}}), but {label} has no 'test_cases' column; {found}")
        if reward in ANSWER_REWARDS and d.answer_key not in present and "gt_answer" not in present:
            problems.append(f"spec.data.answerKey: {field} {reward} compares each response with the row's answer, "
                            f"but {label} has no {d.answer_key!r} column (data.answerKey), nor 'gt_answer'; "
                            f"{found}: set data.answerKey to the column that holds the answer")
    return list(dict.fromkeys(problems))


def _prompt_lengths(rows: list, d: DataSpec, tok: Any) -> tuple[list[int], list[str]]:
    """(token length of each usable row's prompt, the malformed rows' errors)."""
    lengths, errors = [], []
    for i, row in enumerate(rows):
        try:
            lengths.append(len(prompt_record(row, i, tokenizer=tok, source=d.path, prompt_key=d.prompt_key,
                                             messages_key=d.messages_key, answer_key=d.answer_key,
                                             system_prompt=d.system_prompt).token_ids))
        except ROW_ERRORS as err:
            errors.append(str(err))
    return lengths, errors


def _example_lengths(config: TrainerConfig, rows: list, d: DataSpec, tok: Any) -> tuple[list[int], list[str]]:
    """(longest sequence of each usable row's example, the malformed rows' errors)."""
    tokenize = Tokenize(config.method, d, tok)
    lengths, errors = [], []
    for i, row in enumerate(rows):
        try:
            lengths.append(max(seq.length for seq in tokenize.from_row(row, f"{d.path}: row {i}").sequences))
        except ValueError as err:
            errors.append(str(err))
    return lengths, errors


def _judge_malformed(errors: list[str], num_rows: int, whole: bool, s: _Set, report: DataReport) -> None:
    if not errors:
        return
    limit = MAX_MALFORMED_FRACTION * num_rows if whole else num_rows / 2
    text = f"{len(errors)} of the {num_rows if whole else f'first {num_rows}'} rows of {s.label} are malformed"
    if len(errors) > limit:
        report.problems.append(f"{s.field}.path: {text}; the first: {errors[0]}")
    else:
        report.warnings.append(f"{s.field}.path: {text} and will be skipped (skipped_rows; the trainer stops when more "
                               f"than {MAX_MALFORMED_FRACTION:.0%} of all rows are); the first: {errors[0]}")


def _judge_lengths(config: TrainerConfig, lengths: list[int], s: _Set, report: DataReport) -> None:
    """An error when no sampled prompt (offline: example) fits, a warning when most do not."""
    if not config.method.offline:
        usable = [n for n in lengths if n]
        if lengths and not usable:
            report.problems.append(f"{s.field}.path: every sampled prompt of {s.label} tokenizes to nothing; check "
                                   "the prompt column and the tokenizer of model.path")
        field_, limit, noun, scale, note = "spec.data.maxPromptLength", config.data.max_prompt_length, "prompt", 1, ""
    else:
        usable, budget = lengths, config.optim.max_tokens_per_micro_batch
        scale = 2 if config.method in PAIR_METHODS else 1
        field_, noun = "spec.trainer.maxTokensPerMicroBatch", "example"
        limit, note = budget // scale, (f" (each side of a pair gets half of {budget})" if scale == 2 else "")
    if not usable:
        return
    over = sum(n > limit for n in usable)
    keep = sorted(usable)[max(0, math.ceil(KEEP_FRACTION * len(usable)) - 1)] * scale
    of, tokens = f"the {len(usable)} sampled {noun}s of {s.label}", "token" if limit == 1 else "tokens"
    if over == len(usable):
        report.problems.append(f"{field_}: every one of {of} is longer than {limit} {tokens}{note}, the shortest has "
                               f"{min(usable)}; raise it to {keep}, which keeps {KEEP_FRACTION:.0%} of them")
    elif 2 * over > len(usable):
        report.warnings.append(f"{field_}: {over / len(usable):.0%} of {of} are longer than {limit} {tokens}{note} and "
                               f"will be dropped; {keep} keeps {KEEP_FRACTION:.0%} of them")


def _check_builtin(config: TrainerConfig, s: _Set, tokenizer: Callable[[], Any], report: DataReport) -> None:
    """A built-in task's prompts (RL) or examples (offline), sampled as the trainer draws them."""
    d, seed = s.spec, config.schedule.seed
    if d.path == "builtin://gem":
        return  # the environment's prompts: exempt from data.maxPromptLength
    if not config.method.offline:
        tok = tokenizer() if d.path[len("builtin://"):] in BUILTIN_TASKS else None
        try:
            source = PromptSource(d.model_copy(update={"max_prompt_length": sys.maxsize}), tok, seed=seed)
        except ValueError as err:
            report.problems.append(_in_field(str(err), s))
            return
        if tok is not None:
            _judge_lengths(config, [len(p.token_ids) for p in source.next_batch(BUILTIN_SAMPLE)], s, report)
        return
    kind, make = BUILTIN_OFFLINE.get(d.path[len("builtin://"):], (None, None))
    if kind != ("pair" if config.method in PAIR_METHODS else "sft"):
        return  # the preflight names the built-in tasks of the method
    tok = tokenizer()
    if tok is not None:
        rows = [make(random.Random(f"{seed}:{i}")) for i in range(BUILTIN_SAMPLE)]
        try:
            lengths, _ = _example_lengths(config, rows, d, tok)
        except ValueError as err:
            report.problems.append(_in_field(str(err), s))
            return
        _judge_lengths(config, lengths, s, report)
