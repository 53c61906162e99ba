"""The download step: every `hf://` / `s3://` model and dataset of a job into its sources
directory (rlhf_contract.sources has the plan and the layout), once: a copy is kept when
its completion marker reads whole, is of the job's pinned revision (pins.py) and every
file it lists is there with its size; anything else is downloaded afresh into a staging
directory of this process alone (`.partial/<stem>.<host>.<pid>.<random>`), renamed into place,
and only then marked complete (files.write_atomic). So a restart or a second pod with the
same volume downloads nothing, two pods downloading at once (where file locks do not hold
across nodes) each finish a whole copy, and a download cut short (a killed pod, a server
gone mid-file) is never read as a model. Every name a server gives is kept inside its
directory (files.confined): a key with `..` fails the step naming it.

Hub repositories: huggingface_hub's `snapshot_download` at the pinned commit (HF_ENDPOINT,
HF_TOKEN), of the files the job's loader reads only (hub_files.py: a model's from_pretrained
files, a dataset's config and split, the file or folder an address names). S3: MinIO's
client (s3.py), each object at its pinned ETag. A missing
repository, revision, bucket or object, a refused credential, a hostile object name or a
pinned object that changed is permanent (exit 2, naming the field and the Secret); a
Hub 429 or 5xx, an S3 SlowDown or 5xx, is retried inside the step (HUB_RETRY, s3.RETRY; the
server's Retry-After respected); a broken connection is not (exit 1: the job's next attempt
tries again)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

from rlhf_contract.api.uris import DEFAULT_REVISION, parse_remote
from rlhf_contract.sources import PARTIAL_DIR, Fetch

from ..retry import Retry, TryAgain, retry_after
from . import StorageError, cache, credentials_source, hub_files, pins, s3
from .files import listing, listing_matches, remove_abandoned, unique_name, write_atomic

log = logging.getLogger(__name__)

HUB_RETRY = Retry(attempts=8, delay_s=1.0, factor=2.0, max_delay_s=60.0, deadline_s=600.0)
"""A Hub answer of 429 (rate limited) or 5xx: the call is made again inside the step (1, 2, 4 ...
60 s, or the Retry-After the Hub gave, for at most 10 minutes), not by restarting the job;
snapshot_download keeps the files it already has in the staging directory."""


class _HubBusy(TryAgain):
    def __init__(self, err: Exception, after_s: float | None):
        super().__init__(str(err), after_s=after_s)
        self.err = err


def _hub_retried(fn):
    """`fn()`, a Hub 429 or 5xx retried under HUB_RETRY; then the last error goes up as raised."""
    from huggingface_hub.errors import HfHubHTTPError

    def attempt():
        try:
            return fn()
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status == 429 or (status or 0) >= 500:
                log.warning("the Hub answered %s; trying again", status)
                raise _HubBusy(err, retry_after(err.response.headers.get("Retry-After"))) from None
            raise
    try:
        return HUB_RETRY.call(attempt)
    except _HubBusy as last:
        raise last.err from None


def fetch_all(fetches: list[Fetch], cache_dir: str | Path | None = None) -> list[str]:
    """Download what is not there yet; returns one line per fetch (what was done). With
    `cache_dir` (`spec.sourceCache`) each copy is kept once there, by content (cache.py), and
    the job's path is a link to it."""
    root = Path(cache_dir) if cache_dir else None
    return [_fetch_one(f, root) for f in fetches]


def copy_problem(fetch: Fetch, pin: dict | None) -> str | None:
    """Why the copy of `fetch` may not be used as it is (None: it is whole and pinned)."""
    marker = Path(fetch.marker())
    try:
        record = json.loads(marker.read_text())
    except FileNotFoundError:
        return "no completion marker"
    except (OSError, ValueError) as err:
        return f"its marker is unreadable ({err})"
    if not isinstance(record, dict) or record.get("uri") != fetch.uri:
        return "its marker is of another address"
    if pin is not None and not pins.same(pin, record):
        return f"it is not of the pinned revision {pins.summary(pin)}"
    return listing_matches(Path(fetch.local), record.get("files"))


def _fetch_one(fetch: Fetch, cache_root: Path | None) -> str:
    if copy_problem(fetch, pins.read(fetch)) is None:
        return f"{fetch.field}: {fetch.uri} already at {fetch.local}"
    marker = Path(fetch.marker())
    marker.parent.mkdir(parents=True, exist_ok=True)
    # a speed-up only: pods on one node download one at a time, the second finds the
    # first's marker; where the lock does not hold (across nodes), each downloads into its
    # own staging directory and the copies are the same pinned revision
    with open(marker.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = copy_problem(fetch, pins.read(fetch))
        if problem is None:
            return f"{fetch.field}: {fetch.uri} already at {fetch.local} (downloaded by another pod)"
        if Path(fetch.local).exists() or marker.exists():
            log.warning("%s: the copy at %s is not used (%s): downloading it again", fetch.field, fetch.local, problem)
        if cache_root is not None:
            return _through_cache(fetch, marker, cache_root)
        return _download(fetch, marker)


def _through_cache(fetch: Fetch, marker: Path, root: Path) -> str:
    """The copy from the cache (downloaded into it first when it has none whole), linked at
    `fetch.local`; without a pin that names content, downloaded as without a cache."""
    pin = pins.read(fetch) or _resolve(fetch)
    found = cache.entry(root, fetch, pin) if pin is not None else None
    if found is None:
        return _download(fetch, marker)
    found.marker.parent.mkdir(parents=True, exist_ok=True)
    with open(found.marker.with_suffix(".lock"), "w") as lock:  # as _fetch_one's lock, per entry
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = cache.complete(found, pin)
        done = "found in the cache"
        if record is None:
            start = time.monotonic()
            _download(fetch, found.marker, found.path, root / PARTIAL_DIR, sealed=True)
            done = f"downloaded into the cache in {time.monotonic() - start:.1f} s"
            record = json.loads(found.marker.read_text())
    staging = Path(fetch.sources_dir()) / PARTIAL_DIR / unique_name(marker.stem)
    staging.mkdir(parents=True)
    try:
        (staging / "content").symlink_to(found.path)
        _install(Path(fetch.local), staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a link (or the job's old copy) replaced: never the entry
    kept = {k: record[k] for k in ("revision", "objects", "files") if k in record}
    write_atomic(marker, json.dumps({"uri": fetch.uri, "local": fetch.local, "cache": str(found.path), **kept},
                                    indent=1))
    return f"{fetch.field}: {fetch.uri} {done}: {fetch.local} -> {found.path}"


def _resolve(fetch: Fetch) -> dict | None:
    """Pin `fetch` before its place in the cache is chosen (the Hub commit its revision names,
    the S3 objects' ETags); None when the server does not say now: the download that follows
    then reports why (exit 2 or 1) as without a cache."""
    remote = parse_remote(fetch.uri)
    try:
        if remote.scheme == "hf":
            from huggingface_hub import HfApi

            api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
            info = _hub_retried(lambda: api.repo_info(remote.name, repo_type=fetch.kind, revision=remote.ref))
            return pins.record(fetch, {"revision": info.sha}) if info.sha else None
        objects = s3.list_objects(s3.client(remote.name), remote.name, remote.ref)
        return pins.record(fetch, {"objects": objects}) if objects else None
    except (StorageError, ValueError, *s3.errors()) as err:
        log.info("%s: %s not resolved before the download (%s)", fetch.field, fetch.uri, type(err).__name__)
        return None


def _download(fetch: Fetch, marker: Path, target: Path | None = None, partial: Path | None = None, *,
              sealed: bool = False) -> str:
    """Download `fetch` into `target` (the job's copy, or a cache entry: `partial` its staging
    directory, `sealed` its files made read-only), then write `marker`."""
    start = time.monotonic()
    target = target or Path(fetch.local)
    staging = (partial or Path(fetch.sources_dir()) / PARTIAL_DIR) / unique_name(marker.stem)
    staging.mkdir(parents=True)
    remove_abandoned(staging.parent, marker.stem)
    remote = parse_remote(fetch.uri)
    pin = pins.read(fetch)
    try:
        if remote.scheme == "hf":
            record = _hf(fetch, remote.name, remote.ref, staging, pin)
        else:
            record = _s3(fetch, remote.name, remote.ref, staging, pin)
        record["files"] = listing(staging / "content")
        if sealed:
            cache.seal(staging / "content")
        _install(target, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    write_atomic(marker, json.dumps({"uri": fetch.uri, "local": str(target), **record}, indent=1))  # last
    return f"{fetch.field}: {fetch.uri} downloaded to {target} in {time.monotonic() - start:.1f} s"


INSTALL_ATTEMPTS = 8
"""Renames into place tried while other processes keep installing their copies there."""


def _install(target: Path, staging: Path) -> None:
    """Rename the staged copy (or link) into place at `target`; one already there (partial, or
    another process's complete one, or a link) is first renamed aside into this staging
    directory, then deleted with it (a link is removed, not followed). Another process may
    install its copy between the two renames (where the lock does not hold across nodes): its
    copy is whole too, and is moved aside again (the rename refuses a non-empty directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(INSTALL_ATTEMPTS):
        if target.exists() or target.is_symlink():
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                os.replace(target, staging / f"replaced-{attempt}")
        try:
            os.replace(staging / "content", target)
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == INSTALL_ATTEMPTS - 1:
                raise


class _MissingRevision(Exception):
    """The repository exists, the revision does not."""


def _hf(fetch: Fetch, repo: str, revision: str, staging: Path, pin: dict | None) -> dict:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = f"{fetch.field}: {fetch.uri}"
    server = endpoint or "the Hugging Face Hub"
    api = HfApi(endpoint=endpoint)
    try:
        if pin is None:
            try:
                info = _hub_retried(lambda: api.repo_info(repo, repo_type=fetch.kind, revision=revision))
            except RepositoryNotFoundError:
                if revision == DEFAULT_REVISION:
                    raise
                # raises when the repository itself is missing
                _hub_retried(lambda: api.repo_info(repo, repo_type=fetch.kind, revision=DEFAULT_REVISION))
                raise _MissingRevision() from None  # a server that answers 404 to both
            pin = pins.record(fetch, {"revision": info.sha or revision})
        revision = pin["revision"]
        files = _hub_retried(lambda: hub_files.select(fetch, api, repo, revision, staging / "content",
                                                      staging / "hub-cache"))
        _hub_retried(lambda: snapshot_download(repo, repo_type=fetch.kind, revision=revision,
                                               local_dir=staging / "content", endpoint=endpoint,
                                               cache_dir=staging / "hub-cache",
                                               allow_patterns=hub_files.allow_patterns(files)))
    except (RevisionNotFoundError, _MissingRevision):
        raise StorageError(f"{where}: revision {revision!r} not found in the {fetch.kind} repository {repo!r} on "
                           f"{server}; give an existing branch, tag or commit after '@'", permanent=True) from None
    except GatedRepoError:
        raise StorageError(f"{where}: {repo!r} is gated on {server}: accept its terms with the account of "
                           f"{credentials_source('HF_TOKEN')}", permanent=True) from None
    except RepositoryNotFoundError:
        raise StorageError(f"{where}: no {fetch.kind} repository {repo!r} on {server} (or it is private and "
                           f"{credentials_source('HF_TOKEN')} cannot read it); fix the name or the token",
                           permanent=True) from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        permanent = status in (401, 403)
        raise StorageError(f"{where}: {server} answered {status}"
                           + (f": {credentials_source('HF_TOKEN')} is refused" if permanent else
                              f" ({err}) after retries within the step for {HUB_RETRY.deadline_s:.0f} s"
                              if status == 429 or (status or 0) >= 500 else f" ({err})"),
                           permanent=permanent) from None
    except ValueError as err:
        if "Invalid filename" not in str(err):
            raise
        raise StorageError(f"{where}: refusing the repository's file name ({err})", permanent=True) from None
    except OSError as err:  # connection refused or cut (requests/httpx errors are OSErrors here)
        raise StorageError(f"{where}: download from {server} failed ({type(err).__name__}: {err}); the partial "
                           "copy is not used, the next attempt downloads it again", permanent=False) from None
    shutil.rmtree(staging / "content" / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
    _check_inside(staging, fetch)
    return {"revision": revision}


def _check_inside(staging: Path, fetch: Fetch) -> None:
    """huggingface_hub joins the repository's file names itself (refusing `..` and absolute
    ones, exit 2 here); this checks that nothing it wrote is a link out of the copy."""
    root = (staging / "content").resolve()
    for f in (staging / "content").rglob("*"):
        if f.is_symlink() and not f.resolve().is_relative_to(root):
            raise StorageError(f"{fetch.field}: {fetch.uri}: refusing the file {f.relative_to(staging / 'content')}: "
                               "it points outside the copy", permanent=True)


def _s3(fetch: Fetch, bucket: str, prefix: str, staging: Path, pin: dict | None) -> dict:
    where = f"{fetch.field}: {fetch.uri}"
    try:
        client = s3.client(bucket)
        sizes: dict[str, int] = {}
        objects = s3.list_objects(client, bucket, prefix, sizes)
        if not objects:
            raise StorageError(f"{where}: no objects under {prefix or 'the bucket'!r} in bucket {bucket!r} at "
                               f"{s3.endpoint()}; fix the prefix", permanent=True)
        pin = pin or pins.record(fetch, {"objects": objects})
        for key, etag in pin["objects"].items():
            if objects.get(key) != etag:
                now = f"its ETag is {objects[key]!r}" if key in objects else "it is gone"
                raise StorageError(f"{where}: the object {key!r} changed after this job pinned it (pinned ETag "
                                   f"{etag!r}, {now}); a job reads one version of its sources: restore the object, "
                                   f"or start a new job (or delete {fetch.pin_file()}) to read the new one",
                                   permanent=True)
        s3.download(client, bucket, pin["objects"], prefix, staging / "content", where, sizes)
    except s3.errors() as err:
        raise s3.changed_error(err, where) or s3.error(err, where, bucket) from None
    return {"objects": pin["objects"]}
