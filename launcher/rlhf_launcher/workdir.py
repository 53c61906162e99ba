"""`rlhfctl submit --working-dir DIR`: the files of a local directory (a reward function, an
environment, small data) carried to the job's pods in ConfigMaps. Pure: files in, manifests
and the rewritten job document out; cluster_cli.py creates them.

Which files go, and reading them within the caps, is workdir_files.py (ignore files,
`--exclude`, links, credentials, sizes checked before reading); here they are split
over at most `MAX_CONFIGMAPS` ConfigMaps `<job>-workdir[-N]` of under 1 MiB each (the API
server refuses a larger one). The job mounts them read-only at `WORKDIR_MOUNT` through
`spec.pod` (one projected volume; the operator's builders put `spec.pod`'s volumes into every
pod), and each path field of the job that names a file or directory inside DIR (relative
paths are read from the current directory, as local mode does) is rewritten to its place
under `WORKDIR_MOUNT`: the same job file runs locally and on the cluster.

Simplifications: a link inside DIR arrives as a copy of its target; files keep the
ConfigMap volume's mode (0644, nothing executable); a reward file that imports a sibling
module must add the directory to `sys.path` itself (files are loaded by path)."""

from __future__ import annotations

import base64
import copy
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rlhf_contract.api.models import RLHFJob

from .workdir_files import (  # noqa: F401 (MIB, human: the names callers know)
    CONFIGMAP_BYTES, MAX_CONFIGMAPS, MIB, Scan, Selection, WorkdirError, human, listing, select, too_large,
)

WORKDIR_MOUNT = "/opt/rlhf/workdir"
WORKDIR_VOLUME = "rlhf-workdir"
WORKDIR_LABEL = "rlhf.dev/workdir-of"
"""Label of the ConfigMaps holding a job's working directory (not `rlhf.dev/job`: the
operator's children carry that one)."""
_KEY_CHARS = re.compile(r"[^-._a-zA-Z0-9]")


@dataclass(frozen=True)
class WorkdirFile:
    path: str
    """Relative to the working directory, with `/`."""
    data: bytes

    @property
    def text(self) -> str | None:
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    @property
    def stored_bytes(self) -> int:
        """Its size in the ConfigMap (base64 for binary data, as it travels in the request)."""
        return len(self.data) if self.text is not None else len(base64.b64encode(self.data))


@dataclass(frozen=True)
class Packed:
    doc: dict[str, Any]
    """The job document with the mount and the rewritten paths."""
    config_maps: list[dict[str, Any]]
    moved: dict[str, str]
    """Field path -> its path in the pods."""
    files: list[WorkdirFile]
    scan: Scan
    """What was sent, skipped and left out, and why."""

    def listing(self, label: str) -> list[str]:
        """The files sent (path, size, total) and what was not, for the user to read before it goes."""
        return listing(label, self.scan, ", ".join(f"configmap/{cm['metadata']['name']}" for cm in self.config_maps))


def _key(path: str, taken: set[str]) -> str:
    """A ConfigMap key for `path` ([-._a-zA-Z0-9]+; the volume item puts it back at `path`)."""
    base = _KEY_CHARS.sub("_", path.replace("/", "--"))[:240]
    key, n = base, 1
    while key in taken:
        n += 1
        key = f"{base}-{n}"
    taken.add(key)
    return key


def _groups(workdir: Path, files: list[WorkdirFile]) -> list[list[tuple[str, WorkdirFile]]]:
    """`files` with their ConfigMap keys, split into ConfigMaps; refused, naming the size,
    when they would not fit (as stored: base64 for binary files, with the key)."""
    sizes = {f.path: f.stored_bytes for f in files}
    groups: list[list[tuple[str, WorkdirFile]]] = [[]]
    used, taken = 0, set()
    for f in files:
        key = _key(f.path, taken)
        size = len(key) + f.stored_bytes
        if size > CONFIGMAP_BYTES:
            raise WorkdirError(f"--working-dir {workdir}: "
                               + too_large(sizes, f"{f.path} alone does not fit in one ConfigMap"))
        if used + size > CONFIGMAP_BYTES:
            groups.append([])
            used = 0
        groups[-1].append((key, f))
        used += size
    if len(groups) > MAX_CONFIGMAPS:
        raise WorkdirError(f"--working-dir {workdir}: " + too_large(sizes, f"that needs {len(groups)} ConfigMaps"))
    return groups


def config_maps(job_name: str, namespace: str, workdir: Path, files: list[WorkdirFile]
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ConfigMaps holding `files`, and the one projected volume that puts every file back
    at its relative path."""
    cms, sources = [], []
    groups = _groups(workdir, files)
    for i, group in enumerate(groups):
        name = f"{job_name}-workdir" + (f"-{i + 1}" if len(groups) > 1 else "")
        cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": name, "namespace": namespace, "labels": {WORKDIR_LABEL: job_name}}}
        text = {k: f.text for k, f in group if f.text is not None}
        binary = {k: base64.b64encode(f.data).decode() for k, f in group if f.text is None}
        if text:
            cm["data"] = text
        if binary:
            cm["binaryData"] = binary
        cms.append(cm)
        sources.append({"configMap": {"name": name, "items": [{"key": k, "path": f.path} for k, f in group]}})
    return cms, {"name": WORKDIR_VOLUME, "projected": {"sources": sources}}


def path_fields(job: RLHFJob) -> dict[str, tuple[tuple[Any, ...], str]]:
    """Every field of the job that names a local file or directory: field path -> (its
    location in the job document, the path)."""
    s = job.spec
    fields: list[tuple[tuple[Any, ...], str | None]] = [
        (("model", "path"), s.model.path), (("data", "path"), s.data.path),
        (("reward", "file"), s.reward.file),
        (("reward", "model", "path"), s.reward.model.path if s.reward.model else None),
        (("environment", "file"), s.environment.file if s.environment else None),
        *((("rollout", "tools", "functions", i, "file"), f.file)
          for i, f in enumerate(s.rollout.tools.functions if s.rollout.tools else [])),
        *((("reward", "components", i, "file"), c.file) for i, c in enumerate(s.reward.components)),
        # the agent's command: the words that name a file (a script), not its program or flags
        *((("rollout", "agent", "command", i), w) for i, w in enumerate(s.rollout.agent.command if s.rollout.agent else [])
          if i > 0 and not w.startswith("-") and (w.endswith(".py") or "/" in w)),
        # an MCP stdio server's command: its script words, as the agent's
        *((("rollout", "tools", "mcpServers", j, "command", i), w)
          for j, m in enumerate(s.rollout.tools.mcp_servers if s.rollout.tools else [])
          for i, w in enumerate(m.command or []) if i > 0 and not w.startswith("-") and (w.endswith(".py") or "/" in w)),
        *((("evaluation", "datasets", i, "path"), d.path)
          for i, d in enumerate(s.evaluation.datasets if s.evaluation else [])),
    ]
    return {"spec." + ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "["):
            (("spec", *loc), path) for loc, path in fields if path and "://" not in path}


def pack(doc: dict[str, Any], job: RLHFJob, workdir: Path, cwd: Path, namespace: str,
         selection: Selection = Selection()) -> Packed:
    """The ConfigMaps of `workdir` and `doc` (the job as written, overrides applied) mounting
    them, with every path inside `workdir` rewritten to its place in the pods."""
    root = (cwd / workdir).resolve()
    if not root.is_dir():
        raise WorkdirError(f"--working-dir {workdir}: not a directory")
    found, data = select(root, str(workdir), selection)
    files = [WorkdirFile(e.path, data[e.path]) for e in found.entries]
    names = {f.path for f in files}
    cms, volume = config_maps(job.metadata.name, namespace, workdir, files)
    doc = copy.deepcopy(doc)
    moved = {}
    for field, (loc, path) in path_fields(job).items():
        local = (cwd / path).resolve()
        if not local.is_relative_to(root):
            continue
        rel = local.relative_to(root).as_posix()
        if rel != "." and rel not in names and not any(n.startswith(rel + "/") for n in names):
            raise WorkdirError(f"{field}: {path!r} is inside --working-dir {workdir} but no file of it is sent "
                               f"({_why_not_sent(found, rel)}); fix the path or the rule")
        moved[field] = str(PurePosixPath(WORKDIR_MOUNT) / rel) if rel != "." else WORKDIR_MOUNT
        node = doc
        for part in loc[:-1]:
            node = node[part]
        node[loc[-1]] = moved[field]
    pod = doc["spec"].setdefault("pod", {})
    if any(v.get("name") == WORKDIR_VOLUME for v in pod.get("volumes", [])):
        raise WorkdirError(f"spec.pod.volumes: the name {WORKDIR_VOLUME!r} is used by --working-dir; rename the volume")
    pod.setdefault("volumes", []).append(volume)
    mounts = "volume_mounts" if "volume_mounts" in pod else "volumeMounts"
    pod.setdefault(mounts, []).append({"name": WORKDIR_VOLUME, "mountPath": WORKDIR_MOUNT, "readOnly": True})
    return Packed(doc, cms, moved, files, found)


def _why_not_sent(found: Scan, rel: str) -> str:
    """Which rule kept `rel` (or the directory above it) here."""
    parts = rel.split("/")
    for above in ("/".join(parts[:i]) for i in range(len(parts), 0, -1)):
        if above in found.left_out:
            return f"{above} is left out: {found.left_out[above]}"
    skipped = [s for s in found.skipped if s.startswith(rel + " ")]
    return f"skipped: {skipped[0]}" if skipped else "no such file"


def left_behind(job: RLHFJob, cwd: Path, root: Path | None) -> list[str]:
    """Warnings for fields naming a relative path that is a file here but goes to no pod
    (outside the working directory, or no working directory)."""
    out = []
    for field, (_, path) in path_fields(job).items():
        local = (cwd / path).resolve()
        if not PurePosixPath(path).is_absolute() and local.exists() and (root is None or not local.is_relative_to(root)):
            out.append(f"{field}: {path!r} is on this machine only, outside any --working-dir: the pods will not "
                       "have it (pass --working-dir with a directory that holds it)")
    return out
