"""What every pod of a job shares: the config volume, `/dev/shm`, a security context the
`restricted` Pod Security level admits, GPU requests, CPU / memory resources, and the
user's scheduling settings and volumes (`spec.pod`).

`spec.pod` goes into every pod, with `trainer.pod` / `rollout.pod` over it for that role's
pods (the contract's `PodScheduling.over`: labels, annotations, nodeSelector, tolerations,
affinity, topologySpreadConstraints, schedulerName, priorityClassName, runtimeClassName,
securityContext, ServiceAccount annotations, resourceClaims, the accelerator resource);
volumes, mounts and pull secrets are the same for every pod. `spec.output.claimName` mounts a
PersistentVolumeClaim at the output directory of the trainer pods (and, when it is
ReadWriteMany, of the rollout pods that download: storage.py, as `spec.sourceCache` is); a
job with `output.uri` (`s3://`) and neither a claim nor a mount there gets an emptyDir at the
output directory instead (`output_scratch`: the bucket keeps the checkpoints, the download
step restores the newest into a new pod's emptyDir; one trainer node only, since each pod's
emptyDir would hold only its own ranks' shards). `PodSettings.from_job`
also refuses a job whose model, data or output directory is on no mounted volume (the
pods could not read or keep them), naming the field; `builtin://`, `hf://` and `s3://` paths need none
(storage.py downloads the latter). The
old annotation `rlhf.dev/pod-settings` is refused with a pointer to `spec.pod`. The Kueue
queue label (`kueue.x-k8s.io/queue-name`) is copied from the job's labels
(meta.job_labels). `hostPath` volumes are refused unless the operator allows them
(`allow_host_path`, its `security.allowHostPath`); the contract refuses the other
host-reaching settings (rlhf_contract/api/pod_security.py).

Every pod gets `runPolicy.terminationGracePeriodSeconds` between SIGTERM and SIGKILL (the
trainer saves a checkpoint in it).

Simplifications: images are assumed to run as any non-root uid (1000 by default); HOME points
at a writable emptyDir because such a uid has no home directory in most images.
"""

from __future__ import annotations

import copy
import posixpath
from dataclasses import dataclass, field
from typing import Any

from rlhf_contract.api.models import PodScheduling, Resources, RLHFJob
from rlhf_contract.api.pod_security import HOST_PATH
from rlhf_contract.api.uris import hub_id_hint, is_remote
from .meta import ROLE_ROLLOUT, ROLE_TRAINER, config_map_name

POD_SETTINGS_ANNOTATION = "rlhf.dev/pod-settings"
CONFIG_DIR = "/etc/rlhf"
CONFIG_FILE = "trainer.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
DEFAULT_OUTPUT_DIR = "/output"
OUTPUT_VOLUME = "output"
SOURCE_CACHE_VOLUME = "source-cache"
SCRATCH_DIR = "/tmp"
BUILTIN_PREFIX = "builtin://"
RESERVED_VOLUMES = ("config", "dshm", "scratch")


class PodSettingsError(ValueError):
    """The job cannot be laid out in pods (`spec.pod`, `spec.output`); the message names the
    field and says what to change."""


@dataclass(frozen=True)
class PodSettings:
    """Where and how the job's pods are scheduled and what they mount (from `spec.pod`
    and `spec.output.claimName`)."""

    roles: dict[str, PodScheduling] = field(default_factory=dict)
    """Each role's scheduling: `trainer.pod` / `rollout.pod` over `spec.pod`, defaults filled."""
    image_pull_secrets: list[str] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """The user's pod volumes (e.g. a PVC with the model and the data)."""
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    """Mounts of `volumes` into every container."""
    output_claim: str | None = None
    """PVC mounted at the output directory of the trainer pods."""
    output_shared: bool = False
    """`output_claim` is ReadWriteMany (the operator reads the claim's accessModes): the
    rollout pods mount it too and read the trainer's downloads (storage.py)."""
    source_cache_claim: str | None = None
    """`spec.sourceCache.claimName`: the download cache shared by jobs (storage.py)."""
    output_dir: str = DEFAULT_OUTPUT_DIR
    output_scratch: bool = False
    """An emptyDir at the output directory of the trainer pods (`output.uri` without a volume)."""

    @classmethod
    def from_job(cls, job: RLHFJob, *, allow_host_path: bool = False) -> "PodSettings":
        """The job's pod settings, or a PodSettingsError naming the field; `hostPath` volumes
        only with `allow_host_path` (the operator's `security.allowHostPath`)."""
        if POD_SETTINGS_ANNOTATION in job.metadata.annotations:
            raise PodSettingsError(
                f"metadata.annotations[{POD_SETTINGS_ANNOTATION}] is no longer read: move its keys to spec.pod "
                "(nodeSelector, tolerations, affinity, priorityClassName, imagePullSecrets, volumes, volumeMounts) "
                "and delete the annotation")
        from rlhf_contract.api.rules import CLUSTER_RULES, JOB_RULES

        for rule in CLUSTER_RULES:
            if not rule.check(job.spec):
                raise PodSettingsError(rule.problem(rule.detail(job.spec)))
        for rule in JOB_RULES:
            if not rule.check(job):
                raise PodSettingsError(rule.problem(rule.detail(job)))
        p = job.spec.pod
        if not allow_host_path:
            check_no_host_path(p.volumes)
        names = {v["name"] for v in p.volumes}
        taken = sorted(names & set(RESERVED_VOLUMES))
        if taken:
            raise PodSettingsError(f"spec.pod.volumes: the name(s) {', '.join(taken)} are the operator's own "
                                   f"({', '.join(RESERVED_VOLUMES)}); rename the volume")
        out = output_dir(job)
        scratch = bool(job.spec.output.uri) and not job.spec.output.claim_name and mount_of(
            out, [m.model_dump(by_alias=True) for m in p.volume_mounts]) is None
        if (job.spec.output.claim_name or scratch) and OUTPUT_VOLUME in names:
            taken_by = "spec.output.claimName" if job.spec.output.claim_name else "the output emptyDir of spec.output.uri"
            raise PodSettingsError(f"spec.pod.volumes: the name {OUTPUT_VOLUME!r} is taken by {taken_by}; "
                                   "rename the volume")
        if scratch and job.spec.trainer.num_nodes > 1:
            raise PodSettingsError(
                f"spec.output.claimName: a job with spec.output.uri and trainer.numNodes "
                f"({job.spec.trainer.num_nodes}) > 1 needs a ReadWriteMany claim (or a spec.pod.volumeMounts entry "
                f"containing {out!r}): each node writes its own checkpoint shards, which one pod's emptyDir "
                "cannot gather; set output.claimName, or train on one node")
        cache = job.spec.source_cache.claim_name if job.spec.source_cache is not None else None
        if cache and SOURCE_CACHE_VOLUME in names:
            raise PodSettingsError(f"spec.pod.volumes: the name {SOURCE_CACHE_VOLUME!r} is taken by "
                                   "spec.sourceCache.claimName; rename the volume")
        if cache and cache == job.spec.output.claim_name:
            raise PodSettingsError(f"spec.sourceCache.claimName: {cache!r} is also spec.output.claimName; a cache "
                                   "shared by jobs must not be one job's output volume: give each its own claim")
        roles = {ROLE_TRAINER: job.spec.trainer.pod.over(p), ROLE_ROLLOUT: job.spec.rollout.pod.over(p)}
        for role, resources in ((ROLE_TRAINER, job.spec.trainer.resources), (ROLE_ROLLOUT, job.spec.rollout.resources)):
            gpu = roles[role].accelerator_resource
            if gpu in resources.requests or gpu in resources.limits:
                raise PodSettingsError(f"spec.{role}.resources: {gpu} is set from "
                                       f"{'trainer.nprocPerNode' if role == ROLE_TRAINER else 'rollout.tensorParallelSize'}"
                                       "; remove it here")
        settings = cls(
            roles=roles,
            image_pull_secrets=list(p.image_pull_secrets),
            volumes=copy.deepcopy(p.volumes),
            volume_mounts=[m.model_dump(by_alias=True, exclude_defaults=True) for m in p.volume_mounts],
            output_claim=job.spec.output.claim_name,
            source_cache_claim=cache,
            output_dir=out,
            output_scratch=scratch,
        )
        settings.check_paths(job)
        return settings

    def check_paths(self, job: RLHFJob) -> None:
        """The model, the data and the output directory must be on a mounted volume."""
        s = job.spec
        problems = []
        for where, path in (("spec.model.path", s.model.path), ("spec.data.path", s.data.path)):
            if not path.startswith(BUILTIN_PREFIX) and not is_remote(path) and mount_of(path, self.volume_mounts) is None:
                problems.append(f"{where}: " + (hub_id_hint(path) or f"{path!r} is on no mounted volume; add a "
                                "spec.pod.volumes entry (e.g. a persistentVolumeClaim) and a spec.pod.volumeMounts entry "
                                "whose mountPath contains it"))
        if not self.output_claim and not self.output_scratch:
            mount = mount_of(self.output_dir, self.volume_mounts)
            if mount is None:
                problems.append(
                    f"spec.output.dir: {self.output_dir!r} is on no mounted volume, so checkpoints would be lost "
                    "(and uid 1000 cannot create it); set spec.output.claimName to a PersistentVolumeClaim, "
                    "mount a volume containing it with spec.pod.volumeMounts, or set spec.output.uri to an s3:// "
                    "bucket (then a scratch directory suffices)")
            elif mount.get("readOnly"):
                problems.append(f"spec.output.dir: {self.output_dir!r} is on the read-only mount "
                                f"{mount['mountPath']!r}; set readOnly: false or choose another directory")
        if problems:
            raise PodSettingsError("; ".join(problems))

    def role(self, role: str) -> PodScheduling:
        return self.roles[role]

    def trainer_volume_mounts(self) -> list[dict[str, Any]]:
        mounts = copy.deepcopy(self.volume_mounts)
        if self.output_claim or self.output_scratch:
            mounts.append({"name": OUTPUT_VOLUME, "mountPath": self.output_dir})
        return mounts

    def trainer_volumes(self) -> list[dict[str, Any]]:
        vols = copy.deepcopy(self.volumes)
        if self.output_claim:
            vols.append({"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": self.output_claim}})
        elif self.output_scratch:  # the bucket keeps what matters; a new pod restores from it
            vols.append({"name": OUTPUT_VOLUME, "emptyDir": {}})
        return vols


def check_no_host_path(vols: list[dict[str, Any]]) -> None:
    """hostPath volumes reach the node's filesystem (`/`, the container runtime's socket): refused,
    naming each, unless the operator is installed to allow them."""
    found = [f"spec.pod.volumes[{i}].{HOST_PATH}: {(v[HOST_PATH] or {}).get('path')!r}"
             for i, v in enumerate(vols) if HOST_PATH in v]
    if found:
        raise PodSettingsError(
            f"{'; '.join(found)}: hostPath volumes reach the node and this operator is installed without "
            "security.allowHostPath (RLHF_ALLOW_HOST_PATH); put the data on a persistentVolumeClaim (an admin "
            "may back it with a hostPath PersistentVolume), or ask the cluster's admin to allow hostPath")


def mount_of(path: str, mounts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The deepest mount whose mountPath contains `path` after normalisation (None: no mount
    does; `/work/../etc` is on no mount at /work)."""
    path = posixpath.normpath(path)
    best = None
    for m in mounts:
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/") or root == "") and (
                best is None or len(root) > len(best["mountPath"].rstrip("/"))):
            best = m
    return best


def output_dir(job: RLHFJob) -> str:
    return job.spec.output.dir or DEFAULT_OUTPUT_DIR


def container_security_context() -> dict[str, Any]:
    """What the `restricted` Pod Security Standard requires of each container."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_security_context(placement: PodScheduling) -> dict[str, Any]:
    sec = placement.security_context
    out = {
        "runAsNonRoot": True,
        "runAsUser": sec.run_as_user,
        "runAsGroup": sec.run_as_group,
        "fsGroup": sec.fs_group,
        "fsGroupChangePolicy": sec.fs_group_change_policy,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if sec.supplemental_groups:
        out["supplementalGroups"] = list(sec.supplemental_groups)
    return out


def container_resources(gpus: int, resources: Resources, placement: PodScheduling) -> dict[str, Any]:
    """The user's CPU / memory requests and limits plus `gpus` accelerators (request = limit,
    `accelerator_resource`) and the pod's resource claims. A memory request without a limit
    gets the request as its limit, so the pod is not BestEffort and is OOM-killed at a
    predictable size."""
    requests = dict(resources.requests)
    limits = dict(resources.limits)
    if "memory" in requests and "memory" not in limits:
        limits["memory"] = requests["memory"]
    if gpus:  # a CPU role (rollout.engine: cpu, trainer.device: cpu) asks for none
        requests[placement.accelerator_resource] = str(gpus)
        limits[placement.accelerator_resource] = str(gpus)
    out: dict[str, Any] = {"requests": requests, "limits": limits}
    if placement.resource_claims:
        out["claims"] = [{"name": c["name"]} for c in placement.resource_claims]
    return out


def template_metadata(labels: dict[str, str], placement: PodScheduling) -> dict[str, Any]:
    """A pod template's metadata: the user's labels under ours, and the user's annotations."""
    meta: dict[str, Any] = {"labels": {**placement.labels, **labels}}
    if placement.annotations:
        meta["annotations"] = dict(placement.annotations)
    return meta


def env_list(env: dict[str, str]) -> list[dict[str, str]]:
    """The contract's environment plus HOME (a writable directory for the non-root uid)."""
    merged = {"HOME": f"{SCRATCH_DIR}/home", **env}
    return [{"name": k, "value": v} for k, v in sorted(merged.items())]


def volume_mounts(settings: PodSettings, *, trainer: bool = False) -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        *(settings.trainer_volume_mounts() if trainer else copy.deepcopy(settings.volume_mounts)),
    ]


def volumes(job: RLHFJob, settings: PodSettings, *, trainer: bool = False) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": config_map_name(job.metadata.name)}},
        # NCCL and PyTorch data loaders need far more shared memory than the 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "scratch", "emptyDir": {}},
        *(settings.trainer_volumes() if trainer else copy.deepcopy(settings.volumes)),
    ]


def pod_spec(job: RLHFJob, settings: PodSettings, containers: list[dict[str, Any]], *, role: str,
             restart_policy: str, service_account: str | None, automount_token: bool = True) -> dict[str, Any]:
    placement = settings.role(role)
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "securityContext": pod_security_context(placement),
        "containers": containers,
        "volumes": volumes(job, settings, trainer=role == ROLE_TRAINER),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": job.spec.run_policy.termination_grace_period_seconds,
        "automountServiceAccountToken": bool(service_account) and automount_token,
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    optional = {
        "nodeSelector": placement.node_selector, "tolerations": placement.tolerations,
        "affinity": placement.affinity, "topologySpreadConstraints": placement.topology_spread_constraints,
        "schedulerName": placement.scheduler_name, "priorityClassName": placement.priority_class_name,
        "runtimeClassName": placement.runtime_class_name, "resourceClaims": placement.resource_claims,
        "imagePullSecrets": [{"name": s} for s in settings.image_pull_secrets],
    }
    spec.update({key: copy.deepcopy(value) for key, value in optional.items() if value})
    return spec
