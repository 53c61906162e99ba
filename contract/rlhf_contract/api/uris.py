"""`hf://` and `s3://` addresses of models and datasets: their grammar, checked when a spec
is read, so a malformed one is refused with its field path before anything starts.

  hf://<org>/<name>[@<revision>]   a Hugging Face Hub repository (a branch, tag or commit;
                                   default `main`); a model for model fields, a dataset
                                   repository for data fields
  s3://<bucket>[/<prefix>]         every object under the prefix (one object whose key is
                                   the prefix: that file), from an S3-compatible store

Also what a spec may not write in an address or a path: credentials in a URL
(`no_credentials`, with its CEL), `..` in a directory that must stay on its volume.

Pure: no client, no network (rlhf_contract.sources plans the downloads,
rlhf_trainer.storage does them)."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any, Callable
from urllib.parse import parse_qsl, urlsplit

from pydantic import AfterValidator, Field

HF_SCHEME = "hf://"
S3_SCHEME = "s3://"
DEFAULT_REVISION = "main"

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})"
                 r"(@(?P<revision>[A-Za-z0-9][A-Za-z0-9_./-]{0,254}))?$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<prefix>[^\s]*))?$")


@dataclass(frozen=True)
class Remote:
    """One remote model or dataset."""

    uri: str
    scheme: str
    """`hf` or `s3`."""
    name: str
    """hf: the repository id `org/name`; s3: the bucket."""
    ref: str
    """hf: the revision; s3: the key prefix ('' for the whole bucket, no trailing slash)."""


def is_remote(path: str) -> bool:
    return path.startswith((HF_SCHEME, S3_SCHEME))


def parse_remote(uri: str) -> Remote | None:
    """The remote `uri` names (None for a local path or `builtin://`); ValueError saying what
    to write for a malformed `hf://` or `s3://`."""
    if uri.startswith(HF_SCHEME):
        m = _HF.match(uri)
        if m is None or ".." in uri or uri.endswith((".", "/")):
            raise ValueError(f"{uri!r} is not a Hub repository: write hf://<org>/<name> or hf://<org>/<name>@<revision> "
                             "(letters, digits, '-', '_', '.'; the revision a branch, tag or commit)")
        return Remote(uri, "hf", m["repo"], m["revision"] or DEFAULT_REVISION)
    if uri.startswith(S3_SCHEME):
        m = _S3.match(uri)
        prefix = (m["prefix"] or "").strip("/") if m else ""
        if m is None or ".." in m["bucket"] or any(part in (".", "..") for part in prefix.split("/") if prefix):
            raise ValueError(f"{uri!r} is not an S3 location: write s3://<bucket>/<prefix> (bucket: 3-63 lowercase "
                             "letters, digits, '.', '-'; a prefix without '.' or '..' segments)")
        return Remote(uri, "s3", m["bucket"], prefix)
    return None


def check_path(value: str) -> str:
    """A pydantic validator's body: `value` unchanged, or ValueError for a malformed remote."""
    parse_remote(value)
    return value


def check_no_parent(path: str) -> str:
    """A pydantic validator's body for a directory that must stay where it is written (the
    output directory on its volume): `..` segments refused, since `/work/runs/../../etc` is
    `/etc`, on no volume, whatever prefix it starts with."""
    if ".." in PurePosixPath(path).parts:
        raise ValueError(f"{path!r} has a '..' segment (it is {posixpath.normpath(path)!r}); write the directory "
                         "without '..', on the volume it must stay on")
    return path


_SECRET_QUERY = re.compile(r"(?i)^(sig|pwd|auth)$|key|token|secret|signature|password|passwd|credential")


def url_credentials(url: str) -> str | None:
    """What in `url` is a credential (`user:pass@` user info, or a query parameter whose name
    says key / token / secret / signature), or None."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "user info (user:password@)"
    names = [name for name, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_QUERY.search(name)]
    return f"the query parameter {names[0]!r}" if names else None


def no_credentials(secret_field: str) -> Callable[[str | None], str | None]:
    """A pydantic validator's body for a URL field: refused when it carries a credential, which
    would be stored in the job, its ConfigMap, trackers and events; `secret_field` says where
    the credential goes instead."""
    def check(value: str | None) -> str | None:
        found = url_credentials(value) if value else None
        if found:
            raise ValueError(f"carries a credential ({found}), which would be stored in the job and shown where "
                             f"the job is shown; remove it from the URL and give it through {secret_field}")
        return value
    return check


ENV_SECRET = "a Secret: pod.env[].valueFrom.secretKeyRef or pod.envFrom"
MAX_URL_LENGTH = 2048
URL_CEL = ("!self.matches('^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#]*@') && !self.matches('[?&]((?i:sig|pwd|auth)(=|&|#|$)"
           "|[^=&#]*(?i:key|token|secret|signature|password|passwd|credential))')")
"""CEL of `no_credentials` (the query's names matched as `url_credentials` matches them)."""


def EndpointUrl(secret_field: str, **constraints: Any) -> Any:  # noqa: N802 (a type)
    """A URL field's type: at most MAX_URL_LENGTH characters, no credentials (Python and CEL),
    and `constraints` (pattern, min_length: on this type, where the CRD keeps them)."""
    return Annotated[str, Field(max_length=MAX_URL_LENGTH, **constraints, json_schema_extra={"x-kubernetes-validations": [{
        "rule": URL_CEL, "message": f"carries a credential (user info, or a key / token / secret / signature in "
        f"its query); remove it from the URL and give it through {secret_field}"}]}),
        AfterValidator(no_credentials(secret_field))]
