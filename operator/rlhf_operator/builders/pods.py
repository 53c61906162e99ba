"""What every pod of a job shares: the config volume, `/dev/shm`, a security context the
`restricted` Pod Security level admits, GPU requests, and the user's scheduling settings.

Scheduling settings (nodeSelector, tolerations, priorityClassName, imagePullSecrets, and
extra volumes such as the PVC holding the model and the output directory) are not part of
the RLHFJob spec yet; until they are, they come from the JSON annotation
`rlhf.dev/pod-settings` on the job (see `PodSettings.from_job`). The Kueue queue label
(`kueue.x-k8s.io/queue-name`) is copied from the job's labels (meta.job_labels).

Simplifications: images are assumed to run as any non-root uid (1000 here); HOME points
at a writable emptyDir because such a uid has no home directory in most images.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from rlhf_contract.api.models import RLHFJob
from .meta import config_map_name

POD_SETTINGS_ANNOTATION = "rlhf.dev/pod-settings"
GPU_RESOURCE = "nvidia.com/gpu"
CONFIG_DIR = "/etc/rlhf"
CONFIG_FILE = "trainer.json"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
DEFAULT_OUTPUT_DIR = "/output"
SCRATCH_DIR = "/tmp"
RUN_AS_USER = 1000

_SETTING_KEYS = ("nodeSelector", "tolerations", "priorityClassName", "imagePullSecrets", "volumes", "volumeMounts")


class PodSettingsError(ValueError):
    """The `rlhf.dev/pod-settings` annotation is malformed; the message says how."""


@dataclass(frozen=True)
class PodSettings:
    """Where and how the job's pods are scheduled, beyond what the spec says."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    priority_class_name: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    """Extra pod volumes (e.g. a PVC with the model, the data and the output directory)."""
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    """Mounts of `volumes` into every container."""

    @classmethod
    def from_job(cls, job: RLHFJob) -> "PodSettings":
        text = job.metadata.annotations.get(POD_SETTINGS_ANNOTATION)
        if not text:
            return cls()
        where = f"metadata.annotations[{POD_SETTINGS_ANNOTATION}]"
        try:
            data = json.loads(text)
        except ValueError as err:
            raise PodSettingsError(f"{where}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise PodSettingsError(f"{where}: must be a JSON object with keys {', '.join(_SETTING_KEYS)}")
        unknown = sorted(set(data) - set(_SETTING_KEYS))
        if unknown:
            raise PodSettingsError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(_SETTING_KEYS)})")
        checks = {"nodeSelector": dict, "tolerations": list, "priorityClassName": str,
                  "imagePullSecrets": list, "volumes": list, "volumeMounts": list}
        for key, typ in checks.items():
            if key in data and not isinstance(data[key], typ):
                raise PodSettingsError(f"{where}.{key}: must be a JSON {typ.__name__.replace('dict', 'object').replace('list', 'array').replace('str', 'string')}")
        secrets = [s["name"] if isinstance(s, dict) else s for s in data.get("imagePullSecrets", [])]
        if not all(isinstance(s, str) and s for s in secrets):
            raise PodSettingsError(f"{where}.imagePullSecrets: must list secret names")
        return cls(
            node_selector=dict(data.get("nodeSelector", {})),
            tolerations=list(data.get("tolerations", [])),
            priority_class_name=data.get("priorityClassName"),
            image_pull_secrets=secrets,
            volumes=list(data.get("volumes", [])),
            volume_mounts=list(data.get("volumeMounts", [])),
        )


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


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def gpu_resources(gpus: int) -> dict[str, Any]:
    return {"requests": {GPU_RESOURCE: str(gpus)}, "limits": {GPU_RESOURCE: str(gpus)}}


def env_list(env: dict[str, str]) -> list[dict[str, str]]:
    """The contract's environment plus HOME (a writable directory for the non-root uid)."""
    merged = {"HOME": f"{SCRATCH_DIR}/home", **env}
    return [{"name": k, "value": v} for k, v in sorted(merged.items())]


def volume_mounts(settings: PodSettings) -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": SCRATCH_DIR},
        *copy.deepcopy(settings.volume_mounts),
    ]


def volumes(job: RLHFJob, settings: PodSettings) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": config_map_name(job.metadata.name)}},
        # NCCL and PyTorch data loaders need far more shared memory than the 64 MiB default.
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "scratch", "emptyDir": {}},
        *copy.deepcopy(settings.volumes),
    ]


def pod_spec(job: RLHFJob, settings: PodSettings, containers: list[dict[str, Any]], *,
             restart_policy: str, service_account: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "securityContext": pod_security_context(),
        "containers": containers,
        "volumes": volumes(job, settings),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
    }
    if service_account:
        spec["serviceAccountName"] = service_account
        spec["automountServiceAccountToken"] = True
    else:
        spec["automountServiceAccountToken"] = False
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = copy.deepcopy(settings.tolerations)
    if settings.priority_class_name:
        spec["priorityClassName"] = settings.priority_class_name
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    return spec
