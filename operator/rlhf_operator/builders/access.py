"""The trainer's identity: a ServiceAccount and a Role that lets it read its own job and
patch its status (the trainer writes `status.progress`), bound together.

RBAC cannot narrow a grant to one field: the trainer may patch all of its own job's
status, and nothing of any other job (resourceNames).
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import API_GROUP, PLURAL, RLHFJob
from .meta import metadata, trainer_name


def build_service_account(job: RLHFJob, name: str | None = None,
                          annotations: dict[str, str] | None = None, pull_secrets: list[str] = ()) -> dict[str, Any]:
    """The trainer's ServiceAccount (or, with `name`, the rollout servers'), with the
    user's annotations (cloud IAM: `serviceAccountAnnotations`) and, where a pod cannot list
    them itself (backend TrainJob), the image pull secrets its pods get from it."""
    meta = metadata(job, name or trainer_name(job.metadata.name))
    if annotations:
        meta["annotations"] = dict(annotations)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": False}
    if pull_secrets:
        sa["imagePullSecrets"] = [{"name": s} for s in pull_secrets]
    return sa


def build_role(job: RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(job, trainer_name(job.metadata.name)),
        "rules": [
            {"apiGroups": [API_GROUP], "resources": [PLURAL], "resourceNames": [job.metadata.name], "verbs": ["get"]},
            {"apiGroups": [API_GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [job.metadata.name],
             "verbs": ["get", "patch"]},
        ],
    }


def build_role_binding(job: RLHFJob) -> dict[str, Any]:
    name = trainer_name(job.metadata.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": metadata(job, name)["namespace"]}],
    }
