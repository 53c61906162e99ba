"""The download step: every `hf://` / `s3://` model and dataset of a job into its sources
directory (rlhf_contract.sources has the plan and the layout), once: a copy whose
completion marker exists is kept as it is, anything else is downloaded afresh into a
staging directory, renamed into place, and only then marked complete. So a restart or a
second pod with the same volume downloads nothing, and a download cut short (a killed pod,
a server gone mid-file) is never read as a model.

Hub repositories: huggingface_hub's `snapshot_download` (HF_ENDPOINT, HF_TOKEN). S3:
MinIO's client (s3.py). A missing repository, revision, bucket or object, or a refused credential
is permanent (exit 2, naming the field and the Secret); a broken connection is not (exit 1:
the job's next attempt tries again)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

from rlhf_contract.api.uris import DEFAULT_REVISION, parse_remote
from rlhf_contract.sources import Fetch

from . import StorageError, credentials_source, s3

log = logging.getLogger(__name__)

def fetch_all(fetches: list[Fetch]) -> list[str]:
    """Download what is not there yet; returns one line per fetch (what was done)."""
    return [_fetch_one(f) for f in fetches]


def is_complete(fetch: Fetch) -> bool:
    return Path(fetch.marker()).is_file() and Path(fetch.local).exists()


def _fetch_one(fetch: Fetch) -> str:
    if is_complete(fetch):
        return f"{fetch.field}: {fetch.uri} already at {fetch.local}"
    marker = Path(fetch.marker())
    marker.parent.mkdir(parents=True, exist_ok=True)
    # pods sharing the volume (trainer nodes on a ReadWriteMany claim) download one at a
    # time: the second finds the first's marker
    with open(marker.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(fetch):
            return f"{fetch.field}: {fetch.uri} already at {fetch.local} (downloaded by another pod)"
        return _download(fetch, marker)


def _download(fetch: Fetch, marker: Path) -> str:
    start = time.monotonic()
    staging = marker.parent.parent / ".partial" / marker.stem
    shutil.rmtree(staging, ignore_errors=True)  # an earlier attempt's leftovers are never trusted
    staging.mkdir(parents=True)
    remote = parse_remote(fetch.uri)
    try:
        if remote.scheme == "hf":
            record = _hf(fetch, remote.name, remote.ref, staging)
        else:
            record = _s3(fetch, remote.name, remote.ref, staging)
        target = Path(fetch.local)
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / "content", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({"uri": fetch.uri, "local": fetch.local, **record}, indent=1))
    os.replace(tmp, marker)  # written last: the copy counts from here on
    return f"{fetch.field}: {fetch.uri} downloaded to {fetch.local} in {time.monotonic() - start:.1f} s"


class _MissingRevision(Exception):
    """The repository exists, the revision does not."""


def _hf(fetch: Fetch, repo: str, revision: str, staging: Path) -> dict:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = f"{fetch.field}: {fetch.uri}"
    server = endpoint or "the Hugging Face Hub"
    api = HfApi(endpoint=endpoint)
    try:
        try:
            info = api.repo_info(repo, repo_type=fetch.kind, revision=revision)
        except RepositoryNotFoundError:
            if revision == DEFAULT_REVISION:
                raise
            api.repo_info(repo, repo_type=fetch.kind, revision=DEFAULT_REVISION)  # raises when the repository itself is missing
            raise _MissingRevision() from None  # a server that answers 404 to both
        snapshot_download(repo, repo_type=fetch.kind, revision=info.sha or revision, local_dir=staging / "content",
                          endpoint=endpoint, cache_dir=staging / "hub-cache")
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
                           + (f": {credentials_source('HF_TOKEN')} is refused" if permanent else f" ({err})"),
                           permanent=permanent) from None
    except OSError as err:  # connection refused or cut (requests/httpx errors are OSErrors here)
        raise StorageError(f"{where}: download from {server} failed ({type(err).__name__}: {err}); the partial "
                           "copy is not used, the next attempt downloads it again", permanent=False) from None
    shutil.rmtree(staging / "content" / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping
    return {"revision": info.sha or revision}


def _s3(fetch: Fetch, bucket: str, prefix: str, staging: Path) -> dict:
    where = f"{fetch.field}: {fetch.uri}"
    client = s3.client()
    try:
        objects = s3.list_objects(client, bucket, prefix)
        if not objects:
            raise StorageError(f"{where}: no objects under {prefix or 'the bucket'!r} in bucket {bucket!r} at "
                               f"{s3.endpoint()}; fix the prefix", permanent=True)
        s3.download(client, bucket, list(objects), prefix, staging / "content")
    except s3.errors() as err:
        raise s3.error(err, where, bucket) from None
    return {"objects": objects}
