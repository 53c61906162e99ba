"""S3-compatible object storage with MinIO's client (`minio`): every object under a prefix
down into a directory (objects in parallel, a large one in parallel ranged parts), a
directory up under a prefix (its marker file last).

Where, and as whom, from the environment as the AWS SDKs read it:
- endpoint: `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL`, else AWS S3; TLS verified against
  `AWS_CA_BUNDLE` (else `SSL_CERT_FILE`, else certifi's bundle);
- credentials, first that answers (minio's own providers in a `ChainedProvider`): the static
  keys (`AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`: the job's
  storageSecret), the shared credentials file (`AWS_SHARED_CREDENTIALS_FILE`, `AWS_PROFILE`),
  then `IamAwsProvider`: web identity (IRSA: `AWS_ROLE_ARN` + `AWS_WEB_IDENTITY_TOKEN_FILE`,
  STS at `AWS_ENDPOINT_URL_STS` when set), container credentials (EKS Pod Identity / ECS:
  `AWS_CONTAINER_CREDENTIALS_FULL_URI` or `_RELATIVE_URI`, with
  `AWS_CONTAINER_AUTHORIZATION_TOKEN[_FILE]`), the instance profile (IMDSv2; not tried
  against a custom endpoint, nor with `AWS_EC2_METADATA_DISABLED=true`). None of these set:
  unsigned requests (a public bucket);
- region: `AWS_REGION`, else `AWS_DEFAULT_REGION`, else the bucket's own (GetBucketLocation,
  or the region a server names when it refuses the default one, as boto3's redirector
  reads it). A region that is not the bucket's is a config error naming both.

Errors: throttling (SlowDown, 429, 503) and 5xx answers are retried inside the step
(`RETRY`, the server's Retry-After respected); a missing bucket, refused credentials or
a wrong region are permanent (`error`); a broken connection is not (the next attempt).
(boto3 is not used: it pins python-dateutil < 3, which the Kubernetes client of the same
environment cannot take.)"""

from __future__ import annotations

import io
import os
import re
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

from ..retry import Retry, TryAgain, retry_after
from . import StorageError, credentials_source
from .files import confined

T = TypeVar("T")
KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
IAM_ENV = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
           "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
"""Any of these set: the pod has a cloud identity (IRSA, EKS Pod Identity, ECS)."""
_CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                     "InvalidSecurity", "AllAccessDisabled"}
_REGION_CODES = {"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException",
                 "InvalidRegion", "BadRequest"}
_THROTTLE_CODES = {"SlowDown", "SlowDownRead", "SlowDownWrite", "ServiceUnavailable", "InternalError",
                   "RequestTimeout", "TooManyRequests", "Throttling", "ThrottlingException",
                   "RequestLimitExceeded"}
PARALLEL = 8
"""Objects (and ranged parts) downloaded at once."""
PART_BYTES = 32 << 20
"""An object larger than this is read in ranged parts of this size, in parallel."""
RETRY = Retry(attempts=8, delay_s=0.5, factor=2.0, max_delay_s=20.0, deadline_s=180.0)
"""Throttling and 5xx answers of one request: retried inside the step (0.5, 1, 2 ... 20 s, or
the server's Retry-After), for at most 3 minutes; then the step fails with exit 1."""


class NoCredentials(Exception):
    """No provider of the chain gave credentials; `str()` says what was tried."""


class _Throttled(TryAgain):
    """A throttling or 5xx answer, worth another attempt; `err` is the client's error."""

    def __init__(self, err: Exception, after_s: float | None):
        super().__init__(str(err), after_s=after_s)
        self.err = err


def endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"


def region() -> str | None:
    """The region the environment names (None: the bucket's own, discovered)."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def _custom_endpoint() -> bool:
    return bool(os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))


def http_client(*, maxsize: int = PARALLEL + 2, connect_s: float = 30.0, read_s: float = 120.0,
                retries: int = 2) -> Any:
    """A urllib3 pool verifying TLS against AWS_CA_BUNDLE (else SSL_CERT_FILE, else certifi).
    It retries only failed connections; HTTP answers are for `RETRY` to judge."""
    import certifi
    import urllib3

    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=connect_s, read=read_s), maxsize=maxsize, cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("AWS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(total=retries, connect=retries, read=0, status=0, redirect=0, backoff_factor=0.2,
                              respect_retry_after_header=False))


def credentials() -> Any | None:
    """The provider chain (module docstring); None when nothing names a credential (unsigned)."""
    from minio.credentials import AWSConfigProvider, ChainedProvider, EnvAWSProvider, IamAwsProvider, Provider

    tried, providers = [], []
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_SECRET_ACCESS_KEY"):
        providers.append(EnvAWSProvider())
        tried.append("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    if os.path.exists(shared) or os.environ.get("AWS_PROFILE"):
        providers.append(AWSConfigProvider())
        tried.append(f"profile {os.environ.get('AWS_PROFILE') or 'default'!r} of {shared}")
    # STS, container and metadata endpoints: short timeouts, their own retries of 5xx
    import urllib3

    iam_http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=3, read=10), ca_certs=(
        os.environ.get("AWS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or __import__("certifi").where()),
        retries=urllib3.Retry(total=3, backoff_factor=0.5, status_forcelist=[429, 500, 502, 503, 504]))
    if os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        providers.append(IamAwsProvider(custom_endpoint=os.environ.get("AWS_ENDPOINT_URL_STS") or None,
                                        http_client=iam_http))
        tried.append(f"web identity (AWS_ROLE_ARN {os.environ.get('AWS_ROLE_ARN')!r})")
    elif any(os.environ.get(name) for name in IAM_ENV):
        providers.append(IamAwsProvider(http_client=iam_http))
        tried.append("container credentials (AWS_CONTAINER_CREDENTIALS_*)")
    elif not _custom_endpoint() and os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        class InstanceProfile(Provider):
            """IMDS, where an unreachable endpoint means: not on EC2 (no credentials, exit 2)."""

            def __init__(self):
                self.inner = IamAwsProvider(http_client=iam_http)

            def retrieve(self):
                try:
                    return self.inner.retrieve()
                except urllib3.exceptions.HTTPError as err:
                    raise ValueError(f"instance metadata unreachable ({err})") from None

        providers.append(InstanceProfile())
        tried.append("the instance profile (IMDS)")
    if not providers:
        return None

    class Chain(ChainedProvider):
        def retrieve(self):
            try:
                return super().retrieve()
            except ValueError:
                raise NoCredentials("no credentials from " + ", ".join(tried)) from None

    return Chain(providers)


def _minio(region_name: str | None) -> Any:
    from minio import Minio

    url = urlsplit(endpoint())
    return Minio(url.netloc, credentials=credentials(), secure=url.scheme == "https", region=region_name,
                 http_client=http_client())


def bucket_region(err: Exception) -> str | None:
    """The region a server names when it refuses a request for being signed for another
    (x-amz-bucket-region, or AWS's and versitygw's "expecting 'eu-west-3'")."""
    response = getattr(err, "response", None)
    headers = getattr(response, "headers", None) or {}
    if headers.get("x-amz-bucket-region"):
        return headers["x-amz-bucket-region"]
    found = re.search(r"""(?:expecting|use region) ['"]?([a-z0-9-]+)""", str(err))
    return found.group(1) if found else None


def client(bucket: str | None = None) -> Any:
    """A client for `bucket`: in the environment's region, else in the bucket's own (asked
    of the server once here; other errors are left to the first real request to class)."""
    from minio.error import S3Error

    given = region()
    c = _minio(given)
    if given or not bucket:
        return c
    try:
        c.bucket_exists(bucket)  # with no region, minio asks the bucket's location first
    except S3Error as err:
        found = bucket_region(err)
        if found is None and err.code == "AccessDenied":  # a key without s3:GetBucketLocation
            c = _minio("us-east-1")
            try:
                c.bucket_exists(bucket)
            except S3Error as again:
                found = bucket_region(again)
        if found:
            return _minio(found)
    except (NoCredentials, OSError, _http_error()):
        pass
    return c


def _http_error() -> type[Exception]:
    from urllib3.exceptions import HTTPError

    return HTTPError


def errors() -> tuple[type[Exception], ...]:
    """What the client raises: S3 answers, no credentials, broken connections (urllib3's, OSError)."""
    from minio.error import MinioException

    return (MinioException, NoCredentials, _http_error(), OSError)


def _status(err: Exception) -> int | None:
    from minio.error import InvalidResponseError, S3Error, ServerError

    if isinstance(err, S3Error):
        return getattr(err.response, "status", None)
    if isinstance(err, ServerError):
        return err.status_code
    if isinstance(err, InvalidResponseError):
        return getattr(err, "_code", None)
    return None


def retried(fn: Callable[[], T]) -> T:
    """`fn()` (one S3 request), its throttling and 5xx answers retried under `RETRY`; when
    they run out, the last answer goes up as the client raised it."""
    from minio.error import MinioException

    def attempt() -> T:
        try:
            return fn()
        except MinioException as err:
            code, status = getattr(err, "code", None), _status(err)
            if code in _THROTTLE_CODES or status == 429 or (status or 0) >= 500:
                response = getattr(err, "response", None)
                headers = getattr(response, "headers", None) or {}
                raise _Throttled(err, retry_after(headers.get("Retry-After"))) from None
            raise

    try:
        return RETRY.call(attempt)
    except _Throttled as last:
        raise last.err from None


def error(err: Exception, what: str, bucket: str) -> StorageError:
    """A client error as a StorageError that says what to change."""
    from minio.error import S3Error

    if isinstance(err, NoCredentials):
        return StorageError(f"{what}: {err}; give {credentials_source(*KEYS)}, or a cloud identity to the pods "
                            "(IRSA: AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE; EKS Pod Identity)",
                            permanent=True)
    if isinstance(err, S3Error):
        if err.code == "NoSuchBucket":
            return StorageError(f"{what}: the bucket {bucket!r} does not exist at {endpoint()}; fix the bucket name",
                                permanent=True)
        found = bucket_region(err)
        if err.code in _REGION_CODES and found and found != region():
            said = (f"AWS_REGION/AWS_DEFAULT_REGION {region()!r}" if region() else "the region asked")
            return StorageError(f"{what}: the bucket {bucket!r} at {endpoint()} is in region {found!r}, not "
                                f"{said}: set AWS_REGION to {found!r} (in spec.storageSecret or spec.pod.env), or "
                                "unset it to have the bucket's region found", permanent=True)
        if err.code in _CREDENTIAL_CODES:
            return StorageError(f"{what}: access denied ({err.code}) to bucket {bucket!r} at {endpoint()} with "
                                f"{credentials_source(*KEYS)}; give a key that may read (and write, for "
                                "spec.output.uri) it", permanent=True)
        if err.code == "NoSuchKey":
            return StorageError(f"{what}: the object {err.object_name!r} is not in bucket {bucket!r} at "
                                f"{endpoint()}; fix the address", permanent=True)
        if err.code in _REGION_CODES:
            return StorageError(f"{what}: S3 error {err.code} from {endpoint()}: {err.message} (check AWS_REGION "
                                "and the endpoint)", permanent=True)
        busy = err.code in _THROTTLE_CODES or (_status(err) or 0) in (429, *range(500, 600))
        return StorageError(f"{what}: S3 error {err.code} from {endpoint()}: {err.message}"
                            + (f" (still, after {RETRY.deadline_s:.0f} s of retries in this step)" if busy else ""),
                            permanent=False)
    status = _status(err)
    if status is not None:
        busy = status == 429 or status >= 500
        return StorageError(f"{what}: {endpoint()} answered {status} ({type(err).__name__})"
                            + (f", still after {RETRY.deadline_s:.0f} s of retries in this step" if busy else "")
                            + "; the next attempt tries again", permanent=False)
    return StorageError(f"{what}: S3 transfer from {endpoint()} failed ({type(err).__name__}: {err}); the partial "
                        "copy is not used, the next attempt downloads it again", permanent=False)


def list_objects(s3: Any, bucket: str, prefix: str, sizes: dict[str, int] | None = None) -> dict[str, str]:
    """{key: ETag} of the objects at `prefix` (that key) or under `prefix/` (folder markers
    skipped); `sizes`, when given, receives {key: size}."""
    found = {}
    for obj in retried(lambda: list(s3.list_objects(bucket, prefix=prefix or None, recursive=True))):
        key = obj.object_name
        if obj.is_dir or key.endswith("/") or not (not prefix or key == prefix or key.startswith(prefix + "/")):
            continue
        found[key] = (obj.etag or "").strip('"')
        if sizes is not None and obj.size is not None:
            sizes[key] = obj.size
    return found


def download(s3: Any, bucket: str, keys: dict[str, str] | list[str], prefix: str, into: Path, what: str,
             sizes: dict[str, int] | None = None, *, parallel: int = PARALLEL, part_bytes: int = PART_BYTES) -> None:
    """Each key to `into/<key relative to prefix>` (a key equal to the prefix: `into` itself),
    every name checked first (files.confined: a key with `..` never leaves `into`). Given
    {key: ETag}, each object is read only if it still has that ETag (If-Match: a pinned
    object that changed is refused, `changed_error`). `parallel` requests at once; an object
    whose size (`sizes`) is over `part_bytes` is read in ranged parts written in place. The
    first error stops the rest (parts not started are dropped) and goes up."""
    from minio.error import S3Error

    targets = {}
    for key in keys:
        rel = key[len(prefix):].lstrip("/") if prefix else key
        if prefix and not (key == prefix or key.startswith(prefix + "/")):
            raise StorageError(f"{what}: refusing the object {key!r}: it is not under {prefix!r}", permanent=True)
        targets[key] = confined(into, rel, what) if rel else into
    parts: list[tuple[str, Path, int, int]] = []  # (key, target, offset, length; 0: to the end)
    for key, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        size = (sizes or {}).get(key)
        with open(target, "wb") as f:
            if size is not None and size > part_bytes:
                f.truncate(size)  # each part writes its own range
        if size is not None and size > part_bytes:
            parts += [(key, target, offset, min(part_bytes, size - offset)) for offset in range(0, size, part_bytes)]
        else:
            parts.append((key, target, 0, 0))
    etags = keys if isinstance(keys, dict) else {}
    stop = threading.Event()

    def get(key: str, target: Path, offset: int, length: int) -> None:
        if stop.is_set():
            return
        etag = etags.get(key)
        headers = {"If-Match": f'"{etag}"'} if etag else None
        try:
            response = retried(lambda: s3.get_object(bucket, key, offset=offset, length=length,
                                                     request_headers=headers))
        except S3Error as err:
            if err.code == "NoSuchKey":  # listed, then gone
                raise StorageError(f"{what}: the object {key!r} is not in bucket {bucket!r} at {endpoint()} (it "
                                   "was listed, then deleted); fix the address or restore the object",
                                   permanent=True) from None
            raise
        fd = os.open(target, os.O_WRONLY)
        try:
            position = offset
            for chunk in response.stream(1 << 20):
                if stop.is_set():
                    return
                position += os.pwrite(fd, chunk, position)
        finally:
            os.close(fd)
            response.close()
            response.release_conn()

    with ThreadPoolExecutor(max(1, min(parallel, len(parts)))) as pool:
        futures = [pool.submit(get, *part) for part in parts]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            stop.set()
            for f in futures:
                f.cancel()
            raise failed[0].exception()


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
        key = f"{prefix}/{f.relative_to(directory).as_posix()}".lstrip("/")
        retried(lambda: s3.fput_object(bucket, key, str(f)))
        sent += f.stat().st_size
    return sent


def check_writable(s3: Any, bucket: str, key: str) -> None:
    """Write and delete an empty object at `key` (raises the client's error when refused)."""
    retried(lambda: s3.put_object(bucket, key, io.BytesIO(b""), 0))
    retried(lambda: s3.remove_object(bucket, key))
