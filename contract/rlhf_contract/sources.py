"""Where a job's `hf://` and `s3://` models and datasets land, and the job that reads them
there: one plan, computed from the spec alone, used by the download step (the init
container of each pod that needs it, or local mode before anything starts), by the
operator (the config it mounts names the local copies) and by local mode.

Layout under the sources directory (`<output dir>/sources`, on the job's volume):
  hf/<models|datasets>/<org>/<name>/<revision>/   a repository's snapshot
  s3/<bucket>/<key...>                            the objects, by key
  .complete/<sha256(uri)[:16]>.json               written last: the download is whole (it
                                                  lists the files, their sizes and sha256)
  .pins/<sha256(uri)[:16]>.json                   the revision the job reads: the Hub commit
                                                  or the S3 objects' ETags, fixed by the
                                                  job's first download and never changed
  .partial/<marker stem>.<host>.<pid>.<random>/   one download in progress (per process)
so a restart or a second pod with the volume downloads nothing again, every download of
the job reads the same revision, and a copy without its marker, or whose files differ from
it, is never used (rlhf_trainer.storage downloads it afresh).

With `spec.sourceCache` a claim shared by jobs is mounted at SOURCE_CACHE_DIR in every pod
that downloads; each copy is kept there once, by content (the Hub commit, the S3 objects'
ETags: rlhf_trainer.storage.cache), and the path above is a symbolic link to it (the
trainer and rollout containers mount the cache read-only).

Credentials come from the environment by these names (`spec.storageSecret` on a cluster)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath

from .api.models import RLHFJob
from .api.uris import parse_remote

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
    (`model` / `dataset`, for `hf://`), and the local path the job reads instead."""

    field: str
    uri: str
    kind: str
    local: str

    def sources_dir(self) -> str:
        root = PurePosixPath(self.local)
        while root.name != SOURCES_DIR:
            root = root.parent
        return str(root)

    def marker(self) -> str:
        """The completion marker's path."""
        return str(PurePosixPath(self.sources_dir(), COMPLETE_DIR, self._file_name()))

    def pin_file(self) -> str:
        """Where the revision this job reads is recorded (by its first download)."""
        return str(PurePosixPath(self.sources_dir(), PINS_DIR, self._file_name()))

    def _file_name(self) -> str:
        return f"{hashlib.sha256(self.uri.encode()).hexdigest()[:16]}.json"


def local_path(uri: str, kind: str, sources_dir: str) -> str:
    """Where `uri`'s copy lies under `sources_dir`."""
    remote = parse_remote(uri)
    assert remote is not None
    if remote.scheme == "hf":
        return str(PurePosixPath(sources_dir, "hf", f"{kind}s", remote.name, remote.ref.replace("/", "--")))
    return str(PurePosixPath(sources_dir, "s3", remote.name, *([remote.ref] if remote.ref else [])))


def remote_fields(job: RLHFJob) -> list[tuple[str, str, str]]:
    """(field path, address, kind) of every `hf://` / `s3://` path of the job."""
    s = job.spec
    named = [("spec.model.path", s.model.path, "model"), ("spec.data.path", s.data.path, "dataset")]
    if s.reward.model is not None:
        named.append(("spec.reward.model.path", s.reward.model.path, "model"))
    for i, d in enumerate(s.evaluation.datasets if s.evaluation is not None else []):
        named.append((f"spec.evaluation.datasets[{i}].path", d.path, "dataset"))
    return [(f, uri, kind) for f, uri, kind in named if parse_remote(uri) is not None]


def plan(job: RLHFJob, output_dir: str, *, model_only: bool = False) -> list[Fetch]:
    """The downloads of `job` into `<output_dir>/sources` (a rollout server needs only the
    model: `model_only`). One per address: a second field naming it shares the copy."""
    sources = str(PurePosixPath(output_dir, SOURCES_DIR))
    fetches, seen = [], set()
    for field, uri, kind in remote_fields(job):
        if (model_only and field != "spec.model.path") or (uri, kind) in seen:
            continue
        seen.add((uri, kind))
        fetches.append(Fetch(field, uri, kind, local_path(uri, kind, sources)))
    return fetches


def localize(job: RLHFJob, output_dir: str) -> RLHFJob:
    """`job` with every remote path replaced by its local copy (what the processes read)."""
    out = job.model_copy(deep=True)
    sources = str(PurePosixPath(output_dir, SOURCES_DIR))
    s = out.spec
    s.model.path = _local(s.model.path, "model", sources)
    s.data.path = _local(s.data.path, "dataset", sources)
    if s.reward.model is not None:
        s.reward.model.path = _local(s.reward.model.path, "model", sources)
    for d in s.evaluation.datasets if s.evaluation is not None else []:
        d.path = _local(d.path, "dataset", sources)
    return out


def _local(path: str, kind: str, sources: str) -> str:
    return local_path(path, kind, sources) if parse_remote(path) is not None else path


def plan_json(fetches: list[Fetch]) -> str:
    """The plan as the download step's `--plan` argument."""
    return json.dumps([asdict(f) for f in fetches], separators=(",", ":"))


def plan_from_json(text: str) -> list[Fetch]:
    return [Fetch(**item) for item in json.loads(text)]
