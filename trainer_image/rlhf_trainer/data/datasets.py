"""Datasets from local files through Hugging Face `datasets` (the rows; rendering.py turns
them into prompts).

`load_records(path, split=..., config=...)` reads, locally only (no hub):
  - a directory laid out as a Hub dataset repository whose README.md declares `configs:`
    (a downloaded `hf://` snapshot): `datasets.load_dataset` on it with the config (`data.config`;
    none: the repository's default) and the split, their files found as `datasets` finds them
    (its own `MetadataConfigs` and pattern resolution), so a snapshot holding only the
    chosen config's split (what the download step fetches) reads as the whole repository would;
  - a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
  - one JSON, JSONL, CSV, Parquet or Arrow file (chosen by extension);
  - a directory of such files (one format); files named after a split (`train.jsonl`,
    `test-00000.parquet`) become that split, as `datasets` infers them, otherwise all are "train".
  JSON that `datasets` cannot read as a whole (a line that is not JSON, a column whose type
  changes between rows, an empty file) is read again line by line: each line that is not a
  JSON object stays in its place as an `UnreadableRow`, which the row code skips as malformed.
`peek_records(path, split=..., config=..., limit=...)` opens the same layouts, resolves the
same config and split, and reads only the columns, the first `limit` rows and the row count
where the format gives it cheaply (Parquet metadata, Arrow record batches, `save_to_disk`;
for JSON and CSV only when the sample reached the end): what the preflight's data checks read.

A malformed row is skipped and counted (`MalformedRows`) by the code that turns rows into
prompts or examples; more than MAX_MALFORMED_FRACTION of a dataset's rows malformed is an
error naming the first one.

Simplifications: rows are read into memory (fine up to ~1e6 prompts); a JSON array file
(not JSON Lines) is peeked by reading it whole. A Hub-repository directory is given to
`load_dataset` with its split's files resolved (`data_files`): `datasets` alone would infer
the file format from every split of the first config, which a copy of one split lacks; its
standalone `.huggingface.yaml` is not read, nor is the line-by-line JSON fallback applied.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet",
            ".arrow": "arrow"}
"""File extension -> `datasets` packaged builder."""


class DataError(ValueError):
    """A problem of the data itself, found while reading it: no restart can fix it, so the
    trainer ends the job as a config error (exit 2)."""


MAX_MALFORMED_FRACTION = 0.05
"""Malformed rows are skipped and counted (`skipped_rows`) up to this fraction of a dataset's
rows; beyond it the data or its column mapping is wrong, and reading it is an error."""

ROW_ERRORS = (ValueError, TypeError, KeyError, AttributeError)
"""What the row code raises for a row it cannot use (the row is skipped and counted)."""



def column(row: dict, key: str, default: Any = None) -> Any:
    """`row[key]`; for a dotted key that is not itself a column, the nested field it names
    (`reward_model.ground_truth` is `row["reward_model"]["ground_truth"]`, veRL's layout);
    `default` when absent."""
    if key in row or "." not in key:
        return row.get(key, default)
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


_SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")


class UnreadableRow(str):
    """A line of a JSON file that is not a JSON object (the text says why): it keeps its
    place, so row numbers stay those of the file, and the row code skips it."""


@dataclass
class DataSample:
    """The start of a dataset (`peek_records`)."""

    rows: list
    """The first rows, in file order."""
    columns: list[str]
    """The schema's columns (JSON: the keys of the sampled rows)."""
    num_rows: int | None
    """All rows of the split, where the format tells it cheaply; None when unknown."""


def _load_error(path: str, what: str) -> ValueError:
    return ValueError(f"data.path: {what} ({path}); point data.path at a dataset saved with "
                      "save_to_disk, a " + "/".join(sorted(set(BUILDERS))) + " file, or a "
                      "directory of such files")


def _split_error(path: str, split: str, splits: Iterable[str]) -> ValueError:
    return ValueError(f"data.split: {path} has no split {split!r}; it has " + ", ".join(sorted(map(str, splits))))


def _select_split(data: Any, split: str, path: str):
    from datasets import DatasetDict

    if isinstance(data, DatasetDict):
        if split not in data:
            raise _split_error(path, split, data)
        return data[split]
    return data


def _read(path: str, fn, *args, **kwargs):
    """Call a reader; its errors become a ValueError naming the file."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        raise ValueError(f"data.path: could not read {path}: {type(err).__name__}: {err}") from err


def _hub_configs(p: Path):
    """The `configs:` of a directory laid out as a Hub dataset repository (its README.md's
    YAML header, as `datasets` reads it), or None (no README.md, or no configs in it)."""
    if not p.is_dir() or not (p / "README.md").is_file():
        return None
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    card = _read(str(p / "README.md"), DatasetCard.load, p / "README.md")
    return MetadataConfigs.from_dataset_card_data(card.data) or None


def _config_files(p: Path, configs, config: str | None, split: str, path: str) -> tuple[str, list[str]]:
    """(the config's name, the files of `split` in it) of a Hub-repository directory, or a
    ValueError naming data.config or data.split."""
    from datasets.data_files import DataFilesList, get_data_patterns, sanitize_patterns

    names = ", ".join(configs)
    try:
        name = config or configs.get_default_config_name()
    except ValueError as err:  # several marked default
        raise ValueError(f"data.config: {path}: {err}; set data.config to one of {names}") from None
    if name is None:
        raise ValueError(f"data.config: {path} has several configs ({names}) and none is its default; set "
                         "data.config to one")
    if name not in configs:
        raise ValueError(f"data.config: {path} has no config {name!r}; it has {names}")
    params = configs[name]
    base = p / params["data_dir"] if params.get("data_dir") else p
    patterns = (sanitize_patterns(params["data_files"]) if params.get("data_files") is not None
                else _read(path, get_data_patterns, str(base)))
    if split not in patterns:
        raise _split_error(f"{path} (config {name!r})", split, patterns)
    try:
        files = list(DataFilesList.from_patterns(patterns[split], base_path=str(base)))
    except FileNotFoundError:
        files = []
    if not files:
        raise _load_error(path, f"no files of split {split!r} of config {name!r} ({', '.join(patterns[split])})")
    return name, files


def _no_configs(path: str, config: str | None) -> None:
    """data.config names a config of a Hub dataset repository; a plain path has only `default`."""
    if config not in (None, "default"):
        raise ValueError(f"data.config: {path} has no configs (it is no Hub dataset repository with `configs:` in "
                         "its README.md); remove data.config")


def _is_saved(p: Path) -> bool:
    return p.is_dir() and any((p / name).exists() for name in _SAVED_MARKERS)


def _directory_builder(p: Path, path: str) -> str:
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    builders = {BUILDERS[f.suffix] for f in files}
    if not files:
        raise _load_error(path, "the directory holds no data files")
    if len(builders) > 1:
        raise _load_error(path, "the directory mixes formats " + ", ".join(sorted(builders)))
    return builders.pop()


def _split_files(p: Path, split: str, path: str) -> list[Path]:
    """The files of `split`: a single file is every split; a directory's splits are those
    `datasets` infers from the file names."""
    if not p.is_dir():
        if p.suffix not in BUILDERS:
            raise _load_error(path, f"unknown file extension {p.suffix!r}")
        return [p]
    import datasets

    data_files = _read(path, datasets.load_dataset_builder, _directory_builder(p, path),
                       data_dir=str(p)).config.data_files
    if split not in data_files:
        raise _split_error(path, split, data_files)
    return [Path(f) for f in data_files[split]]


def _json_rows(file: Path, limit: int | None = None) -> tuple[list, int | None]:
    """(the first `limit` rows of a JSON array or JSON Lines file, its row count when known)."""
    with open(file, "rb") as f:
        first = next((line for line in f if line.strip()), b"").lstrip(b"\xef\xbb\xbf \t")
        if first.startswith(b"["):  # one JSON array: read whole
            f.seek(0)
            items = _read(str(file), json.loads, f.read())
            rows = [r if isinstance(r, dict) else UnreadableRow(f"item {i} is not a JSON object")
                    for i, r in enumerate(items if isinstance(items, list) else [items])]
            return rows[:limit], len(rows)
        f.seek(0)
        rows: list = []
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) == limit:
                return rows, None  # more rows follow
            try:
                row = json.loads(line.lstrip(b"\xef\xbb\xbf") if number == 1 else line)
            except ValueError as err:
                row = UnreadableRow(f"line {number} is not JSON ({err})")
            rows.append(row if isinstance(row, (dict, UnreadableRow)) else
                        UnreadableRow(f"line {number} is not a JSON object"))
        return rows, len(rows)


def load_records(path: str, *, split: str = "train", config: str | None = None) -> list:
    """Rows of a local dataset (see the module docstring for the accepted layouts)."""
    import datasets

    p = Path(path)
    if not p.exists():
        raise _load_error(path, "does not exist")
    configs = _hub_configs(p)
    if configs is not None:
        name, files = _config_files(p, configs, config, split, path)
        return _read(path, datasets.load_dataset, str(p), name=name, data_files={split: files}, split=split).to_list()
    _no_configs(path, config)
    if _is_saved(p):
        return _select_split(_read(path, datasets.load_from_disk, str(p)), split, path).to_list()
    if p.is_dir():
        builder = _directory_builder(p, path)
        load = partial(datasets.load_dataset, builder, data_dir=str(p))
    elif p.suffix in BUILDERS:
        builder = BUILDERS[p.suffix]
        load = partial(datasets.load_dataset, builder, data_files={split: str(p)}, split=split)
    else:
        raise _load_error(path, f"unknown file extension {p.suffix!r}")
    try:
        data = _read(path, load)
    except ValueError as err:
        if builder != "json":
            raise
        rows = [row for f in _split_files(p, split, path) for row in _read(str(f), _json_rows, f)[0]]
        if rows and all(isinstance(row, UnreadableRow) for row in rows):
            raise ValueError(f"{err}; read line by line, {rows[0]}") from err
        logger.warning("%s; read line by line instead: %d rows", err, len(rows))
        return rows
    # `datasets` infers splits from the file names; all files are "train" otherwise.
    return _select_split(data, split, path).to_list()


def _peek_arrow(file: Path, limit: int) -> DataSample:
    import pyarrow as pa

    with pa.memory_map(str(file)) as source:  # record batches are read in place: counting is cheap
        try:
            reader = pa.ipc.open_stream(source)
            schema, batches = reader.schema, iter(reader)
        except (OSError, pa.lib.ArrowInvalid):  # the Arrow file format, as `datasets` falls back to
            source.seek(0)
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        rows, count = [], 0
        for batch in batches:
            if len(rows) < limit:
                rows += batch.slice(0, limit - len(rows)).to_pylist()
            count += batch.num_rows
    return DataSample(rows, schema.names, count)


def _peek_file(file: Path, limit: int) -> DataSample:
    kind = BUILDERS[file.suffix]
    if kind == "json":
        rows, count = _json_rows(file, limit)
        columns = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r))
        return DataSample(rows, columns, count)
    if kind == "parquet":
        import pyarrow.parquet as pq

        pf, rows = pq.ParquetFile(file), []
        for batch in pf.iter_batches(batch_size=limit) if limit else ():  # a batch ends at a row group's end
            rows += batch.to_pylist()[:limit - len(rows)]
            if len(rows) == limit:
                break
        return DataSample(rows, pf.schema_arrow.names, pf.metadata.num_rows)
    if kind == "arrow":
        return _peek_arrow(file, limit)
    import pandas as pd
    import pyarrow as pa

    try:  # as `datasets`' csv builder reads it: pandas, then Arrow (NaN becomes None)
        frame = pd.read_csv(file, nrows=limit + 1)
    except pd.errors.EmptyDataError:
        return DataSample([], [], 0)
    rows = pa.Table.from_pandas(frame, preserve_index=False).to_pylist()
    return DataSample(rows[:limit], [str(c) for c in frame.columns], len(rows) if len(rows) <= limit else None)


def peek_records(path: str, *, split: str = "train", config: str | None = None, limit: int = 256) -> DataSample:
    """The columns, the first `limit` rows and (where cheap) the row count of `split`, with
    `load_records`' errors for what cannot be opened."""
    p = Path(path)
    if not p.exists():
        raise _load_error(path, "does not exist")
    configs = _hub_configs(p)
    if configs is None:
        _no_configs(path, config)
    files = [Path(f) for f in _config_files(p, configs, config, split, path)[1]] if configs is not None else None
    if files is None and _is_saved(p):
        import datasets

        data = _select_split(_read(path, datasets.load_from_disk, str(p)), split, path)
        return DataSample(data.select(range(min(limit, data.num_rows))).to_list(), list(data.column_names),
                          data.num_rows)
    sample = DataSample([], [], 0)
    for file in files if files is not None else _split_files(p, split, path):
        part = _read(str(file), _peek_file, file, limit - len(sample.rows))
        sample.rows += part.rows
        sample.columns += [c for c in part.columns if c not in sample.columns]
        sample.num_rows = None if sample.num_rows is None or part.num_rows is None else sample.num_rows + part.num_rows
    return sample


class MalformedRows:
    """Counts the rows of `source` skipped as malformed; `check` ends the read when they are
    more than MAX_MALFORMED_FRACTION of its rows."""

    def __init__(self, source: str):
        self.source, self.count, self.first = source, 0, ""

    def skip(self, error: Exception) -> None:
        self.count += 1
        self.first = self.first or str(error)

    def check(self, num_rows: int) -> None:
        if self.count > MAX_MALFORMED_FRACTION * num_rows:
            raise DataError(f"data.path: {self.count} of the {num_rows} rows of {self.source} are malformed (at most "
                             f"{MAX_MALFORMED_FRACTION:.0%} may be skipped); the first: {self.first}")
        if self.count:
            logger.warning("%s: %d malformed rows of %d skipped (skipped_rows); the first: %s", self.source,
                           self.count, num_rows, self.first)
