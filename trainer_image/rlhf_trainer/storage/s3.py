"""S3-compatible object storage with MinIO's client (`minio`): every object under a prefix
down into a directory, a directory up under a prefix (its marker file last). The endpoint,
region and keys come from the environment (AWS_ENDPOINT_URL, AWS_REGION,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN); without an endpoint, AWS S3.
(boto3 is not used: it pins python-dateutil < 3, which the Kubernetes client of the same
environment cannot take.)"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import StorageError, credentials_source
from .files import confined

KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                     "InvalidSecurity", "AllAccessDisabled"}


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"


def client() -> Any:
    from minio import Minio

    url = urlsplit(endpoint())
    return Minio(url.netloc, access_key=os.environ.get("AWS_ACCESS_KEY_ID") or None,
                 secret_key=os.environ.get("AWS_SECRET_ACCESS_KEY") or None,
                 session_token=os.environ.get("AWS_SESSION_TOKEN") or None, secure=url.scheme == "https",
                 region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")


def errors() -> tuple[type[Exception], ...]:
    """What the client raises: S3 answers, and broken connections (urllib3's, OSError)."""
    from minio.error import MinioException
    from urllib3.exceptions import HTTPError

    return (MinioException, HTTPError, OSError)


def error(err: Exception, what: str, bucket: str) -> StorageError:
    """A client error as a StorageError that says what to change."""
    from minio.error import S3Error

    if isinstance(err, S3Error):
        if err.code == "NoSuchBucket":
            return StorageError(f"{what}: the bucket {bucket!r} does not exist at {endpoint()}; fix the bucket name",
                                permanent=True)
        if err.code in _CREDENTIAL_CODES:
            return StorageError(f"{what}: access denied ({err.code}) to bucket {bucket!r} at {endpoint()} with "
                                f"{credentials_source(*KEYS)}; give a key that may read (and write, for "
                                "spec.output.uri) it", permanent=True)
        return StorageError(f"{what}: S3 error {err.code} from {endpoint()}: {err.message}", permanent=False)
    return StorageError(f"{what}: S3 transfer from {endpoint()} failed ({type(err).__name__}: {err}); the partial "
                        "copy is not used, the next attempt downloads it again", permanent=False)


def list_objects(s3: Any, bucket: str, prefix: str) -> dict[str, str]:
    """{key: ETag} of the objects at `prefix` (that key) or under `prefix/` (folder markers skipped)."""
    found = {}
    for obj in s3.list_objects(bucket, prefix=prefix or None, recursive=True):
        key = obj.object_name
        if obj.is_dir or key.endswith("/") or not (not prefix or key == prefix or key.startswith(prefix + "/")):
            continue
        found[key] = (obj.etag or "").strip('"')
    return found


def download(s3: Any, bucket: str, keys: dict[str, str] | list[str], prefix: str, into: Path, what: str) -> None:
    """Each key to `into/<key relative to prefix>` (a key equal to the prefix: `into` itself),
    every name checked first (files.confined: a key with `..` never leaves `into`). Given
    {key: ETag}, each object is read only if it still has that ETag (If-Match: a pinned
    object that changed is refused, `changed_error`)."""
    targets = {}
    for key in keys:
        rel = key[len(prefix):].lstrip("/") if prefix else key
        if prefix and not (key == prefix or key.startswith(prefix + "/")):
            raise StorageError(f"{what}: refusing the object {key!r}: it is not under {prefix!r}", permanent=True)
        targets[key] = confined(into, rel, what) if rel else into
    for key, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        etag = keys.get(key) if isinstance(keys, dict) else None
        s3.fget_object(bucket, key, str(target), request_headers={"If-Match": f'"{etag}"'} if etag else None)


def changed_error(err: Exception, what: str) -> StorageError | None:
    """An If-Match refusal as the permanent error it is (the object changed after the job
    pinned it); None for any other error."""
    from minio.error import S3Error

    if isinstance(err, S3Error) and err.code == "PreconditionFailed":
        return StorageError(f"{what}: the object {err.object_name!r} changed after this job pinned it (its ETag is "
                            "no longer the pinned one); a job reads one version of its sources: start a new job "
                            "(or delete its sources/.pins/ file) to use the new objects", permanent=True)
    return None


def upload_dir(s3: Any, directory: Path, bucket: str, prefix: str, *, last: str | None = None) -> int:
    """Every file of `directory` to `<prefix>/<relative path>`, the file named `last` after
    all others (a reader that sees it sees the rest). Returns the bytes sent."""
    files = sorted(f for f in directory.rglob("*") if f.is_file())
    files.sort(key=lambda f: f.name == last)
    sent = 0
    for f in files:
        s3.fput_object(bucket, f"{prefix}/{f.relative_to(directory).as_posix()}".lstrip("/"), str(f))
        sent += f.stat().st_size
    return sent


def check_writable(s3: Any, bucket: str, key: str) -> None:
    """Write and delete an empty object at `key` (raises the client's error when refused)."""
    s3.put_object(bucket, key, io.BytesIO(b""), 0)
    s3.remove_object(bucket, key)
