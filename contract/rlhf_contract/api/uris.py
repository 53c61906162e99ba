"""`hf://` and `s3://` addresses of models and datasets: their grammar, checked when a spec
is read, so a malformed one is refused with its field path before anything starts.

  hf://<org>/<name>[@<revision>]   a Hugging Face Hub repository (a branch, tag or commit;
                                   default `main`); a model for model fields, a dataset
                                   repository for data fields
  s3://<bucket>[/<prefix>]         every object under the prefix (one object whose key is
                                   the prefix: that file), from an S3-compatible store

Pure: no client, no network (rlhf_contract.sources plans the downloads,
rlhf_trainer.storage does them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
