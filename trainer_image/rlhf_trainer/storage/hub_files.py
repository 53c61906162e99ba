"""Which files of a Hub repository the download step fetches: what the job's loader reads,
and no more (fetch.py passes them to `snapshot_download` as `allow_patterns`).

A model (`model_files`, from the repository's listing): in the folder the address names
(the repository's root without one), the weights `from_pretrained` loads, in its order of
preference: `model.safetensors`; else the shards a `model.safetensors.index.json` names;
else every `*.safetensors` there; only when there are none, `pytorch_model.bin`, the shards
of `pytorch_model.bin.index.json`, or every `*.bin` / `*.pt` / `*.pth`. Beside them the
folder's own small files: `*.json` (config, generation config, tokenizer config, special
tokens, the weights' index), `*.txt` (merges, vocab), `*.model` / `*.tiktoken`
(sentencepiece / tiktoken vocabularies), `*.jinja` (the chat template) and
`additional_chat_templates/*.jinja`. Not fetched: other folders (`original/`, `onnx/`,
...), `.bin` / `.pt` / `.pth` duplicates of safetensors weights, safetensors the index does
not name (Mistral's `consolidated.safetensors`), gguf, onnx, flax (`*.msgpack`), TensorFlow
(`*.h5`) and Rust (`*.ot`) weights, and model code (`*.py`: no job trusts remote code).

A dataset (`dataset_files`): with a path in the address, the file or every file of the
folder it names; else the files `datasets` itself reads for the config and split (its
`load_dataset_builder` on the Hub repository at the pinned commit), plus README.md (the
card whose `configs:` the trainer reads again on the copy).

Errors the spec can fix (an unknown config, split, file or folder) are `StorageError`s
naming the field, permanent."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Callable

from rlhf_contract.api.uris import parse_remote
from rlhf_contract.sources import Fetch

from . import StorageError

SMALL_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
"""Files beside the weights that a model's config, tokenizer and chat template are read from."""
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
README = "README.md"


def _weights(names: set[str], index: Callable[[str], dict]) -> set[str]:
    """The weight files `from_pretrained` loads among `names` (relative to the model's folder)."""
    for single, index_name, suffixes in (("model.safetensors", "model.safetensors.index.json", (".safetensors",)),
                                         ("pytorch_model.bin", "pytorch_model.bin.index.json", TORCH_SUFFIXES)):
        if single in names:
            return {single}
        if index_name in names:
            return {str(f) for f in index(index_name).get("weight_map", {}).values()}
        found = {n for n in names if "/" not in n and n.endswith(suffixes)}
        if found:
            return found
    return set()


def model_files(listing: list[str], folder: str, index: Callable[[str], dict]) -> list[str]:
    """The files (repository paths) a model's download takes from `listing`: see the module
    docstring. `index(name)` reads a weights index (its name relative to `folder`)."""
    prefix = f"{folder}/" if folder else ""
    names = {f[len(prefix):] for f in listing if f.startswith(prefix)}
    weights = _weights(names, index)
    safetensors = any(w.endswith(".safetensors") for w in weights)
    small = {n for n in names if ("/" not in n or n.startswith("additional_chat_templates/")) and
             n.endswith(SMALL_SUFFIXES) and not (safetensors and n == "pytorch_model.bin.index.json")}
    return sorted(prefix + n for n in weights | small)


def folder_files(listing: list[str], path: str) -> list[str]:
    """The file `path` of `listing`, or every file under the folder `path`."""
    return sorted(f for f in listing if f == path or f.startswith(path + "/"))


def _field(fetch: Fetch, name: str) -> str:
    """`spec.data.config` for the fetch of `spec.data.path`."""
    return fetch.field.rsplit(".", 1)[0] + "." + name


def dataset_files(fetch: Fetch, repo: str, revision: str, listing: list[str], cache: Path) -> list[str]:
    """The files (repository paths) `datasets` reads for the config and split of `fetch`
    (a whole dataset repository), and README.md."""
    from datasets.exceptions import DatasetsError

    try:
        return _dataset_files(fetch, repo, revision, listing, cache)
    except (DatasetsError, ValueError) as err:  # the repository as `datasets` reads it (its card, its files)
        raise StorageError(f"{fetch.field}: {fetch.uri}: `datasets` cannot read the repository at {revision} "
                           f"({type(err).__name__}: {err}); fix its README's configs, or name a file or folder "
                           "inside it (hf://datasets/<org>/<name>/<path>)", permanent=True) from None


def _dataset_files(fetch: Fetch, repo: str, revision: str, listing: list[str], cache: Path) -> list[str]:
    import datasets

    where = f"{fetch.field}: {fetch.uri}"
    kwargs = {"revision": revision, "download_config": datasets.DownloadConfig(cache_dir=str(cache))}
    names = datasets.get_dataset_config_names(repo, **kwargs)
    name = fetch.config or datasets.get_dataset_default_config_name(repo, **kwargs)
    if name is None and len(names) == 1:
        name = names[0]
    if name is None:
        raise StorageError(f"{where} has several configs ({', '.join(names)}) and none is its default; set "
                           f"{_field(fetch, 'config')} to one", permanent=True)
    if name not in names:
        raise StorageError(f"{_field(fetch, 'config')}: {fetch.uri} has no config {name!r}; it has "
                           f"{', '.join(names)}", permanent=True)
    data_files = datasets.load_dataset_builder(repo, name, cache_dir=str(cache), **kwargs).config.data_files or {}
    split = fetch.split or "train"
    if split not in data_files:
        raise StorageError(f"{_field(fetch, 'split')}: {fetch.uri} (config {name!r}) has no split {split!r}; it has "
                           f"{', '.join(map(str, data_files))}", permanent=True)
    root = f"hf://datasets/{repo}@{revision}/"
    return sorted({f.removeprefix(root) for f in data_files[split] if f.startswith(root)} | ({README} & set(listing)))


def select(fetch: Fetch, api, repo: str, revision: str, content: Path, cache: Path) -> list[str]:
    """The repository paths the download of `fetch` takes at `revision` (a commit), from the
    repository's listing; `content` is the copy being made (a weights index is read there)."""
    from huggingface_hub import hf_hub_download

    folder = parse_remote(fetch.uri).path
    listing = api.list_repo_files(repo, repo_type=fetch.kind, revision=revision)
    where = f"{fetch.field}: {fetch.uri}"
    if folder and not folder_files(listing, folder):
        raise StorageError(f"{where}: no file or folder {folder!r} in the {fetch.kind} repository {repo!r} at "
                           f"{revision}; fix the path after the repository", permanent=True)
    if fetch.kind == "dataset":
        return folder_files(listing, folder) if folder else dataset_files(fetch, repo, revision, listing, cache)

    def index(name: str) -> dict:
        path = hf_hub_download(repo, f"{folder}/{name}" if folder else name, revision=revision, local_dir=content,
                               endpoint=api.endpoint, cache_dir=cache)
        return read_json(Path(path))

    files = model_files(listing, folder, index)
    if not any(f.endswith((".safetensors", *TORCH_SUFFIXES)) for f in files):
        raise StorageError(f"{where}: no weights from_pretrained reads (*.safetensors, or pytorch_model*.bin) in "
                           f"{folder or 'the repository'!r}; name the folder that holds the model", permanent=True)
    return files


def allow_patterns(files: list[str]) -> list[str]:
    """`files` as `snapshot_download`'s allow_patterns (fnmatch: each matches only itself)."""
    return [glob.escape(f) for f in files]


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
