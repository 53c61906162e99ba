"""The code sandbox of a job with `reward.type: code` (and no `reward.sandbox.url`): model-written
programs run OUT of the trainer's pod, in `<job>-sandbox` pods that hold nothing worth taking.

  StatefulSet `<job>-sandbox`  `sandboxService.replicas` pods of the trainer image running
                               `python -m rlhf_trainer.sandbox.service` as PID 1;
                               `restricted` Pod Security level; no service-account token
                               (automountServiceAccountToken: false, and the default account);
                               no data, config or output volumes; read-only root filesystem;
                               CPU and memory request = limit,
                               which size the service's queue
                               (`sandboxService.cpu/memory`).
  Service `<job>-sandbox`      ClusterIP, port 8080: what the trainer calls.
  NetworkPolicy `<job>-sandbox` ingress only from this job's trainer pods on 8080; NO egress at
                               all (not even DNS), so a program cannot reach the rollout servers,
                               the trainer, the API server or the internet.

The sandbox pods carry `rlhf.dev/sandbox-of: <job>`, NOT `rlhf.dev/job`: the job's own
NetworkPolicy admits every pod with `rlhf.dev/job` to the trainer's and rollout servers' ports.

Per-run namespaces inside the pod (bubblewrap) need user namespaces, which the RuntimeDefault
seccomp profile forbids; `reward.sandbox.seccompLocalhostProfile` names a node profile that
allows them (still `restricted`). Without it, `reward.requireSandboxIsolation: false` lets the
pod run programs with resource limits only (the pod is then the barrier); with it true and no
user namespaces, scoring fails with an error that says so.

A StatefulSet (not a Deployment) because it is the apps/v1 kind this operator already applies and
is allowed to; its pods are interchangeable (`podManagementPolicy: Parallel`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlhf_contract import sandbox as contract
from rlhf_contract.api.models import RLHFJob
from .meta import LABEL_JOB, LABEL_ROLE, ROLE_TRAINER, http_service, metadata
from rlhf_contract.api.models import PodScheduling
from .pods import container_security_context, pod_security_context

TMP_SIZE_LIMIT = "2Gi"
"""emptyDir at /tmp: the service's per-run stdin/stdout files."""


def code_rewards(job: RLHFJob) -> list:
    """The job's code reward functions (main or components) that use the operator's sandbox."""
    return [f for f in job.spec.reward.functions() if f.type == "code" and f.sandbox.url is None]


def wants_sandbox(job: RLHFJob) -> bool:
    """The operator runs a sandbox service for this job."""
    return bool(code_rewards(job))


def sandbox_pod_labels(job: RLHFJob) -> dict[str, str]:
    return {contract.LABEL_SANDBOX_OF: job.metadata.name}


def _seccomp(job: RLHFJob) -> dict[str, str]:
    profile = job.spec.sandbox_service.seccomp_localhost_profile
    return {"type": "Localhost", "localhostProfile": profile} if profile else {"type": "RuntimeDefault"}


SANDBOX_UID_BASE = 1_000_000_000
SANDBOX_UID_RANGE = 1_000_000_000
"""A job's sandbox pods run as a uid of this range derived from the job's uid: processes of
one uid are counted together by the kernel (RLIMIT_NPROC) across every pod of the node, so a
uid shared with other workloads (the trainers' 1000 with their many threads) would leave
model-written programs unable to fork."""


def sandbox_uid(job: RLHFJob) -> int:
    key = (job.metadata.model_extra or {}).get("uid") or f"{job.metadata.namespace}/{job.metadata.name}"
    return SANDBOX_UID_BASE + int(hashlib.sha256(key.encode()).hexdigest(), 16) % SANDBOX_UID_RANGE


def _own_uid(job: RLHFJob) -> dict[str, int]:
    uid = sandbox_uid(job)
    return {"runAsUser": uid, "runAsGroup": uid, "fsGroup": uid}


def build_sandbox_statefulset(job: RLHFJob) -> dict[str, Any]:
    s = job.spec.sandbox_service
    name = contract.sandbox_name(job.metadata.name)
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = {
        "name": "sandbox",
        "image": job.spec.trainer.image,
        "command": contract.sandbox_command(
            require_isolation=all(f.require_sandbox_isolation for f in code_rewards(job))),
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "TMPDIR", "value": "/tmp"}],
        "ports": [{"name": "http", "containerPort": contract.SANDBOX_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": s.cpu, "memory": s.memory},
                      "limits": {"cpu": s.cpu, "memory": s.memory}},
        "securityContext": {**container_security_context(), "readOnlyRootFilesystem": True,
                            "seccompProfile": _seccomp(job)},
        "readinessProbe": {**probe, "failureThreshold": 3},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec = {
        "securityContext": {**pod_security_context(PodScheduling().over(PodScheduling())), **_own_uid(job),
                            "seccompProfile": _seccomp(job)},
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE_LIMIT}}],
        "terminationGracePeriodSeconds": 5,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(job, name),
        "spec": {
            "serviceName": name,
            "replicas": s.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": sandbox_pod_labels(job)},
            "template": {"metadata": {"labels": sandbox_pod_labels(job)}, "spec": pod_spec},
        },
    }


def build_sandbox_service(job: RLHFJob) -> dict[str, Any]:
    return http_service(job, contract.sandbox_name(job.metadata.name), sandbox_pod_labels(job), contract.SANDBOX_PORT)


def build_sandbox_network_policy(job: RLHFJob) -> dict[str, Any]:
    trainers = {"podSelector": {"matchLabels": {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_TRAINER}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, contract.sandbox_name(job.metadata.name)),
        "spec": {
            "podSelector": {"matchLabels": sandbox_pod_labels(job)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [trainers], "ports": [{"port": contract.SANDBOX_PORT, "protocol": "TCP"}]}],
            "egress": [],
        },
    }


def build_sandbox(job: RLHFJob) -> list[dict[str, Any]]:
    """The sandbox children of `job` (none unless `wants_sandbox`)."""
    if not wants_sandbox(job):
        return []
    return [build_sandbox_network_policy(job), build_sandbox_service(job), build_sandbox_statefulset(job)]

