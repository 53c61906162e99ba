"""Where a job's `hf://` and `s3://` models and datasets land, and the job that reads them
there: one plan, computed from the spec alone, used by the download step (the init
container of each pod that needs it, or local mode before anything starts), by the
operator (the config it mounts names the local copies) and by local mode.

Layout under the sources directory (`<output dir>/sources`, on the job's volume):
  hf/models/<org>/<name>/<revision>/              a model repository's snapshot (the files
                                                  from_pretrained reads, rlhf_trainer.storage.hub_files)
  hf/<models|datasets>/<org>/<name>/<revision>+<selection>/
                                                  the part of a repository a job reads: a
                                                  dataset's config and split (`main.train`,
                                                  `default.train` for the repository's default),
                                                  or the path an address names (`sub--dir`)
  s3/<bucket>/<key...>                            the objects, by key
  .complete/<sha256(uri)[:16]>.json               written last: the download is whole (it
                                                  lists the files, their sizes and sha256)
  .pins/<sha256(uri)[:16]>.json                   the revision the job reads: the Hub commit
                                                  or the S3 objects' ETags, fixed by the
                                                  job's first download and never changed
  .partial/<marker stem>.<host>.<pid>.<random>/   one download in progress (per process)
(a revision with '/' is written with '--'; a selection of other characters than letters,
digits and `_.=-` by a hash), so a restart or a second pod with the volume downloads nothing
again, every download of the job reads the same revision, and a copy without its marker, or
whose files differ from it, is never used (rlhf_trainer.storage downloads it afresh).

With `spec.sourceCache` a claim shared by jobs is mounted at SOURCE_CACHE_DIR in every pod
that downloads; each copy is kept there once, by content (the Hub commit, the S3 objects'
ETags: rlhf_trainer.storage.cache), and the path above is a symbolic link to it (the
trainer and rollout containers mount the cache read-only).

Credentials come from the environment by these names (`spec.storageSecret` on a cluster)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath

from .api.models import RLHFJob
from .api.uris import Remote, parse_remote, repo_kind

SOURCES_DIR = "sources"
"""Under the output directory."""
SOURCE_CACHE_DIR = "/var/cache/rlhf-sources"
"""Where `spec.sourceCache` is mounted, the same path in every pod (the links point there)."""
COMPLETE_DIR = ".complete"
PINS_DIR = ".pins"
PARTIAL_DIR = ".partial"

CREDENTIAL_ENV = ("HF_TOKEN", "HF_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                  "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION")
"""The keys of `spec.storageSecret` the download step and the trainer read (the rest of the
AWS chain, rlhf_trainer.storage.s3, comes from the pods' environment: IRSA's and Pod
Identity's variables, AWS_CA_BUNDLE, AWS_PROFILE)."""
ENV_STORAGE_SECRET = "RLHF_STORAGE_SECRET"
"""The Secret's name, so that an error can name it (unset: the credentials are this environment's)."""


@dataclass(frozen=True)
class Fetch:
    """One download: the spec field that names it, its address, the repository kind
    (`model` / `dataset`, for `hf://`), the local copy's directory, and for a whole Hub
    dataset repository the config (None: the repository's default) and split to download."""

    field: str
    uri: str
    kind: str
    local: str
    config: str | None = None
    split: str | None = None

    def reads(self) -> str:
        """The path the job reads: the copy, or inside it the file or folder the address names."""
        remote = parse_remote(self.uri)
        return str(PurePosixPath(self.local, remote.path)) if remote is not None and remote.path else self.local

    def sources_dir(self) -> str:
        root = PurePosixPath(self.local)
        while root.name != SOURCES_DIR:
            root = root.parent
        return str(root)

    def marker(self) -> str:
        """The completion marker's path (one per copy: per address and selection)."""
        selection = "" if self.config is None and self.split is None else f"\n{self.config or ''}\n{self.split or ''}"
        return str(PurePosixPath(self.sources_dir(), COMPLETE_DIR, _file_name(self.uri + selection)))

    def pin_file(self) -> str:
        """Where the revision this job reads is recorded (by its first download; one per
        address, shared by its selections)."""
        return str(PurePosixPath(self.sources_dir(), PINS_DIR, _file_name(self.uri)))


def _file_name(key: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


_SAFE_LABEL = re.compile(r"^[A-Za-z0-9_.=-]{1,100}$")


def selection_suffix(remote: Remote, config: str | None, split: str | None) -> str:
    """The directory suffix of a copy that is part of a repository ('' for a whole one)."""
    if remote.path:
        label = remote.path.replace("/", "--")
    elif config is not None or split is not None:
        label = f"{config or 'default'}.{split}"
    else:
        return ""
    ok = _SAFE_LABEL.match(label) and not label.startswith(".")
    return "+" + (label if ok else "h-" + hashlib.sha256(label.encode()).hexdigest()[:16])


def local_path(uri: str, kind: str, sources_dir: str, config: str | None = None, split: str | None = None) -> str:
    """Where `uri`'s copy lies under `sources_dir` (for a Hub dataset repository: the copy
    of `config` and `split`)."""
    remote = parse_remote(uri)
    assert remote is not None
    if remote.scheme == "hf":
        revision = remote.ref.replace("/", "--") + selection_suffix(remote, config, split)
        return str(PurePosixPath(sources_dir, "hf", f"{repo_kind(uri, kind)}s", remote.name, revision))
    return str(PurePosixPath(sources_dir, "s3", remote.name, *([remote.ref] if remote.ref else [])))


def _fetch(field: str, uri: str, kind: str, sources: str, config: str | None = None,
           split: str | None = None) -> Fetch | None:
    """The download of one path (None: a local one); a whole Hub dataset repository is
    downloaded for its config and split only."""
    remote = parse_remote(uri)
    if remote is None:
        return None
    kind = repo_kind(uri, kind)
    if not (remote.scheme == "hf" and kind == "dataset" and not remote.path):
        config = split = None
    return Fetch(field, uri, kind, local_path(uri, kind, sources, config, split), config, split)


def _fetches(job: RLHFJob, sources: str) -> list[tuple[Fetch | None, object]]:
    """(download or None, the spec part whose `path` it is) of every path of the job."""
    s = job.spec
    out = [(_fetch("spec.model.path", s.model.path, "model", sources), s.model),
           (_fetch("spec.data.path", s.data.path, "dataset", sources, s.data.config, s.data.split), s.data)]
    if s.reward.model is not None:
        out.append((_fetch("spec.reward.model.path", s.reward.model.path, "model", sources), s.reward.model))
    for i, d in enumerate(s.evaluation.datasets if s.evaluation is not None else []):
        out.append((_fetch(f"spec.evaluation.datasets[{i}].path", d.path, "dataset", sources, d.config, d.split), d))
    return out


def remote_fields(job: RLHFJob) -> list[tuple[str, str, str]]:
    """(field path, address, kind) of every `hf://` / `s3://` path of the job."""
    return [(f.field, f.uri, f.kind) for f, _ in _fetches(job, SOURCES_DIR) if f is not None]


def plan(job: RLHFJob, output_dir: str, *, model_only: bool = False) -> list[Fetch]:
    """The downloads of `job` into `<output_dir>/sources` (a rollout server needs only the
    model: `model_only`). One per copy: a second field naming the same address (and, for
    a dataset repository, the same config and split) shares it."""
    sources = str(PurePosixPath(output_dir, SOURCES_DIR))
    fetches, seen = [], set()
    for fetch, _ in _fetches(job, sources):
        if fetch is None or (model_only and fetch.field != "spec.model.path") or fetch.local in seen:
            continue
        seen.add(fetch.local)
        fetches.append(fetch)
    return fetches


def localize(job: RLHFJob, output_dir: str) -> RLHFJob:
    """`job` with every remote path replaced by the path its local copy gives (what the processes read)."""
    out = job.model_copy(deep=True)
    for fetch, part in _fetches(out, str(PurePosixPath(output_dir, SOURCES_DIR))):
        if fetch is not None:
            part.path = fetch.reads()
    return out


def plan_json(fetches: list[Fetch]) -> str:
    """The plan as the download step's `--plan` argument."""
    return json.dumps([asdict(f) for f in fetches], separators=(",", ":"))


def plan_from_json(text: str) -> list[Fetch]:
    return [Fetch(**item) for item in json.loads(text)]
