"""Names, labels and owner references shared by every child of an RLHFJob.

Every child is named from the job (`<job>-config`, `<job>-rollout`, `<job>-trainer`, ...),
carries `rlhf.dev/job: <job>` and is owned by the job (controller=true), so the garbage
collector removes it with the job and two reconciles can never create two of it.
Pods also carry `rlhf.dev/attempt` (the restart attempt they belong to) and
`rlhf.dev/job-uid` (so pods of an earlier job with the same name are never mistaken for
this job's).
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import API_GROUP, API_VERSION, KIND, KUEUE_QUEUE_LABEL, RLHFJob

LABEL_JOB = "rlhf.dev/job"
LABEL_JOB_UID = "rlhf.dev/job-uid"
LABEL_ROLE = "rlhf.dev/role"
LABEL_ATTEMPT = "rlhf.dev/attempt"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "rlhf-operator"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
"""Kueue's WorkloadPriorityClass of a job (read from the JobSet / PyTorchJob it admits)."""

ROLE_ROLLOUT = "rollout"
ROLE_TRAINER = "trainer"

# The JobSet backend: names of the replicated jobs, and JobSet's own labels on its pods.
RJOB_TRAINER = ROLE_TRAINER
RJOB_ROLLOUT = ROLE_ROLLOUT
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_RESTART_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def rollout_name(job: str) -> str:
    """The rollout StatefulSet and its headless Service."""
    return f"{job}-rollout"


def trainer_name(job: str) -> str:
    """The PyTorchJob, the trainer's ServiceAccount, Role and RoleBinding."""
    return f"{job}-trainer"


def jobset_name(job: str) -> str:
    """The JobSet (backend JobSet) and the headless Service JobSet makes for its pods."""
    return job


def weight_sync_name(job: str) -> str:
    return f"{job}-weight-sync"


def network_policy_name(job: str) -> str:
    return job


def namespace_of(job: RLHFJob) -> str:
    return job.metadata.namespace or "default"


def uid_of(job: RLHFJob) -> str:
    uid = (job.metadata.model_extra or {}).get("uid")
    if not uid:
        raise ValueError(f"job {job.metadata.name!r} has no metadata.uid (read it from the API server)")
    return uid


def owner_reference(job: RLHFJob) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job.metadata.name,
        "uid": uid_of(job),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(job: RLHFJob) -> dict[str, str]:
    """Labels of every child object (not pods: see `pod_labels`)."""
    labels = {LABEL_JOB: job.metadata.name, LABEL_MANAGED_BY: MANAGER}
    for key in (KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL):  # what Kueue reads, from the job's own labels
        if job.metadata.labels.get(key):
            labels[key] = job.metadata.labels[key]
    return labels


def pod_labels(job: RLHFJob, role: str, attempt: int) -> dict[str, str]:
    return {**job_labels(job), LABEL_ROLE: role, LABEL_ATTEMPT: str(attempt), LABEL_JOB_UID: uid_of(job)}


def attempt_of(obj: dict[str, Any]) -> int | None:
    """The restart attempt a pod (or workload) belongs to: ours (`rlhf.dev/attempt`), or
    JobSet's restart-attempt label on the pods of a JobSet backend's JobSet (which carry no
    attempt of ours; a TrainJob's pods carry both: JobSet's stays 0, each attempt is a new JobSet)."""
    labels = obj.get("metadata", {}).get("labels") or {}
    try:
        return int(labels.get(LABEL_ATTEMPT, labels.get(JOBSET_RESTART_LABEL, "")))
    except ValueError:
        return None


def metadata(job: RLHFJob, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace_of(job),
        "labels": labels or job_labels(job),
        "ownerReferences": [owner_reference(job)],
    }


def http_service(job: RLHFJob, name: str, selector: dict[str, str], port: int) -> dict[str, Any]:
    """A ClusterIP Service `name` of the job: `port` to the selected pods' `http` port."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, name),
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
