"""`spec.backend: JobSet`: the trainer and the rollout servers as ONE JobSet
(jobset.x-k8s.io/v1alpha2, kubernetes-sigs/jobset v0.12).

Replicated jobs:
- `trainer`: one Indexed Job of `numNodes` pods (parallelism = completions); node rank is
  the pod's completion index, the rendezvous host is pod 0's stable name
  `<job>-trainer-0-0.<job>.<ns>.svc` in the headless Service JobSet makes for its pods
  (`network.subdomain` = the JobSet's name). torchrun reads PET_NNODES / PET_NODE_RANK /
  PET_MASTER_ADDR / PET_MASTER_PORT, as it does under the training-operator.
- `rollout` (method rl only): `replicas` Jobs of one pod each: server i is
  `<job>-rollout-i-0.<job>.<ns>.svc`.

The restart domain is JobSet's failure policy: every Job has backoffLimit 0, so any pod
failing fails its Job and JobSet recreates ALL Jobs (restart attempt + 1) until
`failurePolicy.maxRestarts` (= `runPolicy.maxRestarts`) is spent; then the JobSet is
Failed. Disruptions (a pod's `DisruptionTarget` condition: preemption, a drain's eviction;
the trainer's exit 143 after SIGTERM) fail the Job through its podFailurePolicy and the
JobSet rule `disruption` restarts everything without spending maxRestarts
(RestartJobSetAndIgnoreMaxRestarts). The permanent exit codes (`rlhf_contract.exit_codes.PERMANENT`) go through each Job's
podFailurePolicy (action FailJob, reason `PodFailurePolicy`) to the JobSet rule that fails
it at once. Success: the trainer Job completing (successPolicy All on `trainer`); JobSet
then deletes the still-running servers. Kueue: the queue label sits on the JobSet, which
Kueue admits as one workload (trainer and rollout GPUs together).

What the operator still does for this backend: the support children (config, RBAC,
services, network policy), suspend (JobSet's own `spec.suspend`), the deadline and the TTL,
and the job's status read from the JobSet and its pods (status.py).
"""

from __future__ import annotations

from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BACKENDS
from rlhf_contract.exit_codes import PERMANENT, ExitCode

from .meta import (
    COMPLETION_INDEX_LABEL, JOBSET_RESTART_LABEL, LABEL_ATTEMPT, RJOB_ROLLOUT, RJOB_TRAINER, ROLE_ROLLOUT, ROLE_TRAINER,
    job_labels, jobset_name, metadata, namespace_of, pod_labels, trainer_name,
)
from .pods import PodSettings, pod_spec, template_metadata
from .storage import with_storage
from .workloads import rollout_container, rollout_endpoints, rollout_service_account, trainer_container, weight_sync_addr

JOBSET_API_VERSION = BACKENDS["JobSet"].api_version
PERMANENT_RULE = "permanentExitCode"
DISRUPTION_RULE = "disruption"


def trainer_master_addr(job: RLHFJob) -> str:
    js = jobset_name(job.metadata.name)
    return f"{js}-{RJOB_TRAINER}-0-0.{js}.{namespace_of(job)}.svc"


# The Job controller's message for a pod failure policy match ("Pod ns/x has condition
# DisruptionTarget matching FailJob rule at index 1", "Container trainer for pod ns/x failed
# with exit code 143 matching ..."): what the JobSet's disruption rule matches.
DISRUPTION_PATTERNS = ["has condition DisruptionTarget matching", f"failed with exit code {int(ExitCode.TERMINATED)} matching"]


def _job_spec(template: dict[str, Any], pods: int, *, trainer: bool) -> dict[str, Any]:
    rules = [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": sorted(PERMANENT)}},
        # Kubernetes took the pod away (preemption, drain): restarted without spending maxRestarts
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
    if trainer:  # the trainer stopped on SIGTERM after saving its checkpoint
        rules.append({"action": "FailJob", "onExitCodes": {"operator": "In", "values": [int(ExitCode.TERMINATED)]}})
    return {
        "parallelism": pods,
        "completionMode": "Indexed",
        "completions": pods,
        "backoffLimit": 0,  # a failed pod fails the Job, and JobSet restarts everything
        "podFailurePolicy": {"rules": rules},
        "template": template,
    }


def _pod_labels(job: RLHFJob, role: str) -> dict[str, str]:
    """Ours without `rlhf.dev/attempt`: a JobSet's pods carry the attempt as JobSet's
    restart-attempt label."""
    labels = pod_labels(job, role, 0)
    del labels[LABEL_ATTEMPT]
    return labels


def build_jobset(job: RLHFJob, settings: PodSettings) -> dict[str, Any]:
    t, name = job.spec.trainer, jobset_name(job.metadata.name)
    node_env = [
        {"name": "PET_NNODES", "value": str(t.num_nodes)},
        {"name": "PET_NODE_RANK",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_LABEL}']"}}},
        {"name": "PET_MASTER_ADDR", "value": trainer_master_addr(job)},
        {"name": "PET_MASTER_PORT", "value": str(contract.TRAINER_MASTER_PORT)},
    ]
    trainer = trainer_container(job, settings, rollout_endpoints=rollout_endpoints(job),
                                weight_sync_addr=weight_sync_addr(job), name="trainer", extra_env=node_env,
                                attempt_label=JOBSET_RESTART_LABEL)
    trainer_template = {
        "metadata": template_metadata(_pod_labels(job, ROLE_TRAINER), settings.role(ROLE_TRAINER)),
        "spec": with_storage(job, settings, pod_spec(job, settings, [trainer], role=ROLE_TRAINER, restart_policy="Never",
                                                     service_account=trainer_name(job.metadata.name)),
                             trainer=True),
    }
    replicated = [{"name": RJOB_TRAINER, "replicas": 1,
                   "template": {"spec": _job_spec(trainer_template, t.num_nodes, trainer=True)}}]
    if not job.spec.trainer_pods_only:  # colocated: the servers run in the trainer's pods
        rollout_template = {
            "metadata": template_metadata(_pod_labels(job, ROLE_ROLLOUT), settings.role(ROLE_ROLLOUT)),
            "spec": with_storage(job, settings, pod_spec(job, settings, [rollout_container(job, settings)],
                                                         role=ROLE_ROLLOUT, restart_policy="Never",
                                                         service_account=rollout_service_account(job, settings),
                                                         automount_token=False), trainer=False),
        }
        replicated.append({"name": RJOB_ROLLOUT, "replicas": job.spec.rollout.replicas,
                           "template": {"spec": _job_spec(rollout_template, 1, trainer=False)}})
    spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [RJOB_TRAINER]},
        "failurePolicy": {
            "maxRestarts": job.spec.run_policy.max_restarts,
            "restartStrategy": "Recreate",
            "rules": [  # the first that matches acts
                {"name": DISRUPTION_RULE, "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"], "onJobFailureMessagePatterns": DISRUPTION_PATTERNS},
                {"name": PERMANENT_RULE, "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            ],
        },
        "replicatedJobs": replicated,
    }
    if job.spec.suspend:
        spec["suspend"] = True
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": metadata(job, name, job_labels(job)),
        "spec": spec,
    }
