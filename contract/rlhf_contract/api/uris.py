"""`hf://` and `s3://` addresses of models and datasets: their grammar, checked when a spec
is read, so a malformed one is refused with its field path before anything starts.

  hf://[<type>/]<org>/<name>[@<revision>][/<path>]
        a Hugging Face Hub repository, as huggingface_hub's own `parse_hf_uri` reads it:
        <type> `models` or `datasets` (without it: a model for model fields, a dataset
        repository for data fields); <revision> a branch, tag or commit (default `main`;
        one segment: a branch with '/' is written with %2F, except `refs/pr/<n>` and
        `refs/convert/<name>`); <path> a file or folder inside the repository (a model in a
        subfolder; a dataset's file or folder, read as a local one would be)
  s3://<bucket>[/<prefix>]         every object under the prefix (one object whose key is
                                   the prefix: that file), from an S3-compatible store

Also what a spec may not write in an address or a path: credentials in a URL
(`no_credentials`, with its CEL), `..` in a directory that must stay on its volume; and the
hint for a bare Hub id written as a path (`hub_id_hint`).

Pure: no client, no network (rlhf_contract.sources plans the downloads,
rlhf_trainer.storage does them)."""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Annotated, Any, Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import AfterValidator, Field

HF_SCHEME = "hf://"
S3_SCHEME = "s3://"
DEFAULT_REVISION = "main"

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,254}$")
_SPECIAL_REF = re.compile(r"^refs/(?:convert/[\w.-]+|pr/\d+)")
"""Revisions that hold '/' and still end at their own end (huggingface_hub's rule)."""
_PATH_SEGMENT = re.compile(r"^[^\s*?\[\]]+$")
_S3 = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(?P<prefix>[^\s]*))?$")
HUB_TYPES = {"models": "model", "datasets": "dataset"}
"""The type prefixes of `hf://` (huggingface_hub's; spaces, kernels and buckets are not models or data)."""


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
    repo_type: str | None = None
    """hf: `model` / `dataset` when the address says so (`hf://datasets/...`), else None."""
    path: str = ""
    """hf: the file or folder inside the repository ('' for the whole repository)."""


def is_remote(path: str) -> bool:
    return path.startswith((HF_SCHEME, S3_SCHEME))


_HF_FORMS = ("write hf://<org>/<name>, hf://datasets/<org>/<name> or hf://models/<org>/<name>, then optionally "
             "@<revision> (a branch, tag or commit; a branch with '/' as %2F) and /<path> (a file or folder in the "
             "repository)")


def _hf_error(uri: str, what: str) -> ValueError:
    return ValueError(f"{uri!r} is not a Hub address: {what}; {_HF_FORMS}")


def _parse_hf(uri: str) -> Remote:
    """`hf://[<type>/]<id>[@<revision>][/<path>]`, split as huggingface_hub's parse_hf_uri
    splits it (tests/unit/test_storage.py compares the two), with this project's limits."""
    body = uri[len(HF_SCHEME):]
    repo_type = None
    first, _, rest = body.partition("/")
    if first in ("spaces", "kernels", "buckets"):
        raise _hf_error(uri, f"a {first[:-1]} is not a model or a dataset")
    if first in ("model", "dataset"):
        raise _hf_error(uri, f"the type prefix is plural ({first}s/)")
    if first in HUB_TYPES:
        repo_type, body = HUB_TYPES[first], rest
    at = body.find("@")
    if at == -1 or body[:at].count("/") > 1:  # no revision ('@' in a file name is literal)
        parts = body.split("/", 2)
        repo, revision, path = "/".join(parts[:2]), None, parts[2] if len(parts) > 2 else ""
    else:
        repo, after = body[:at], body[at + 1:]
        special = _SPECIAL_REF.match(after)
        if special:
            revision, path = special.group(), after[special.end():].removeprefix("/")
        else:
            revision, _, path = after.partition("/")
        revision = unquote(revision)
        if not _REVISION.match(revision) or ".." in revision or revision.endswith((".", "/")):
            raise _hf_error(uri, f"the revision {revision!r} is not a branch, tag or commit name")
    if not _REPO_ID.match(repo) or ".." in repo or repo.endswith("."):
        raise _hf_error(uri, f"{repo!r} is not a repository id <org>/<name> (letters, digits, '-', '_', '.')")
    if path or body.endswith("/"):
        segments = path.split("/")
        bad = next((seg for seg in segments if seg in ("", ".", "..") or not _PATH_SEGMENT.match(seg)), None)
        if bad is not None:
            raise _hf_error(uri, f"the path {path!r} in the repository has an empty, '.', '..' or wildcard segment "
                                 f"({bad!r})")
    return Remote(uri, "hf", repo, revision or DEFAULT_REVISION, repo_type, path)


def parse_remote(uri: str) -> Remote | None:
    """The remote `uri` names (None for a local path or `builtin://`); ValueError saying what
    to write for a malformed `hf://` or `s3://`."""
    if uri.startswith(HF_SCHEME):
        return _parse_hf(uri)
    if uri.startswith(S3_SCHEME):
        m = _S3.match(uri)
        prefix = (m["prefix"] or "").strip("/") if m else ""
        if m is None or ".." in m["bucket"] or any(part in (".", "..") for part in prefix.split("/") if prefix):
            raise ValueError(f"{uri!r} is not an S3 location: write s3://<bucket>/<prefix> (bucket: 3-63 lowercase "
                             "letters, digits, '.', '-'; a prefix without '.' or '..' segments)")
        return Remote(uri, "s3", m["bucket"], prefix)
    return None


def check_path(value: str, kind: str | None = None) -> str:
    """A pydantic validator's body: `value` unchanged, or ValueError for a malformed remote,
    or an `hf://` address of the other repository type than the field's `kind` (`model` /
    `dataset`)."""
    remote = parse_remote(value)
    if remote is not None and kind is not None and remote.repo_type not in (None, kind):
        other = "datasets" if kind == "dataset" else "models"
        raise ValueError(f"{value!r} names a {remote.repo_type} repository and this field reads a {kind}: write "
                         f"hf://{other}/{remote.name}... (or hf://{remote.name}...)")
    return value


def repo_kind(uri: str, field_kind: str) -> str:
    """The Hub repository type an `hf://` address names in a field that reads `field_kind`."""
    remote = parse_remote(uri)
    return (remote.repo_type if remote is not None and remote.repo_type else None) or field_kind


def hub_id_hint(path: str) -> str | None:
    """For a path written as a bare Hub id (`Qwen/Qwen3-0.6B`: relative, `<org>/<name>`, no
    scheme), what to write instead; None for anything else. The caller checks that no such
    local path exists first (a relative `data/train` on this machine is a path)."""
    if (is_remote(path) or "://" in path or path.startswith((".", "/", "~")) or not _REPO_ID.match(path)
            or path.endswith((".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt"))):  # a file, not a repository
        return None
    return (f"{path!r} is no path here and reads as a Hugging Face Hub repository id: write hf://{path} to "
            "download it (hf://datasets/<org>/<name> for a dataset repository), or give a path that exists")


CONFIG_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$"


def check_config(config: str | None, path: str) -> str | None:
    """A pydantic validator's body for a dataset's `config`: unchanged, or ValueError saying
    why it cannot apply to the dataset at `path` (config_problem)."""
    problem = config_problem(path, config)
    if problem:
        raise ValueError(problem)
    return config


def config_problem(path: str, config: str | None) -> str | None:
    """Why `config` cannot apply to the dataset at `path` (None: it can)."""
    if config is None:
        return None
    remote = parse_remote(path) if path.startswith(HF_SCHEME) else None
    if path.startswith("builtin://") or (remote is not None and remote.path) or path.startswith(S3_SCHEME):
        return (f"config {config!r} names a config of a Hub dataset repository (its README's `configs:`), and "
                f"{path!r} is none: remove it, or give the repository as hf://datasets/<org>/<name>")
    return None


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
