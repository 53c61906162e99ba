"""The download cache shared by jobs (`spec.sourceCache`: a claim mounted at
rlhf_contract.sources.SOURCE_CACHE_DIR in every pod that downloads). Each copy is kept
there once, under a name made of what identifies its content, so a second job (or attempt,
or pod) that pins the same content downloads nothing, and changed content gets a new name:

  hf/<models|datasets>/<org>/<name>/<commit>[+<selection>]
                                                  a Hub repository at one commit (40 hex), or the
                                                  part of it a job reads (sources.py's selection)
  s3/<bucket>/<sha256 of the address and its sorted key=ETag lines, 16 hex>
                                                  the objects of one address at those ETags
                                                  (a directory, or the one object)
  .complete/<sha256 of the entry's name, 16 hex>.json
                                                  written last: the entry is whole (the
                                                  revision or ETags, every file, size, sha256)
  .partial/<stem>.<host>.<pid>.<random>/          one download in progress (per process)

The rules are those of the job's own sources directory (fetch.py): staging per process, a
file lock per entry, rename into place, the marker last, names confined, sizes checked on
reuse. An entry's files are made read-only (0444) once whole. The job's own copy
(`<output>/sources/...`, the path its processes read) is a symbolic link to the entry,
with the job's marker beside it; the trainer and rollout containers mount the cache
read-only, so nothing a job writes through its sources directory reaches another job's copy
(only the download step, this code, mounts it writable).

Not done: nothing is evicted (delete an entry and its marker while no job uses it; a job
whose link points to a deleted entry downloads it again on its next attempt), and a Hub
revision that does not resolve to a commit, or an S3 object without an ETag, is not cached
(it is downloaded into the job's sources directory as without a cache)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rlhf_contract.api.uris import parse_remote
from rlhf_contract.sources import COMPLETE_DIR, Fetch, selection_suffix

from . import pins
from .files import listing_matches

COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class Entry:
    """One cached copy: where its content lies and its completion marker."""

    path: Path
    marker: Path


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry(root: Path, fetch: Fetch, pin: dict) -> Entry | None:
    """The entry of `fetch` pinned to `pin` under the cache `root`; None when the pin names no
    content (a Hub revision that is not a commit, an S3 object without an ETag)."""
    remote = parse_remote(fetch.uri)
    if "revision" in pin:
        commit = str(pin["revision"])
        if not COMMIT.fullmatch(commit):
            return None
        # part of a repository (a dataset's config and split, a path inside it) is its own entry
        name = PurePosixPath("hf", f"{fetch.kind}s", remote.name,
                             commit + selection_suffix(remote, fetch.config, fetch.split))
    else:
        objects = pin.get("objects") or {}
        if not objects or not all(isinstance(v, str) and v for v in objects.values()):
            return None
        lines = "".join(f"{key}={etag}\n" for key, etag in sorted(objects.items()))
        name = PurePosixPath("s3", remote.name, _digest(f"{fetch.uri}\n{lines}"))
    return Entry(root.joinpath(*name.parts), root / COMPLETE_DIR / f"{_digest(str(name))}.json")


def complete(e: Entry, pin: dict) -> dict | None:
    """The entry's marker when the entry is whole and of `pin`'s content, else None."""
    try:
        record = json.loads(e.marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("local") != str(e.path) or not pins.same(pin, record):
        return None
    return record if listing_matches(e.path, record.get("files")) is None else None


def seal(content: Path) -> None:
    """Make a staged copy's files read-only (a guard against a slip: the mount is the wall)."""
    for f in [content] if content.is_file() else content.rglob("*"):
        if f.is_file() and not f.is_symlink():
            os.chmod(f, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
