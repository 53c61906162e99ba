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
and the job's status read from the JobSet and its pods (`JobSetBackend.plan`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BACKENDS
from rlhf_contract.exit_codes import PERMANENT, ExitCode

from ..builders.meta import (
    COMPLETION_INDEX_LABEL, JOBSET_NAME_LABEL, JOBSET_RESTART_LABEL, JOBSET_RJOB_LABEL, LABEL_ATTEMPT, RJOB_ROLLOUT,
    RJOB_TRAINER, ROLE_ROLLOUT, ROLE_TRAINER, attempt_of, job_labels, jobset_name, metadata, namespace_of, pod_labels,
    trainer_name,
)
from ..builders.pods import PodSettings, pod_spec, template_metadata
from ..builders.storage import with_storage
from ..builders.workloads import rollout_container, rollout_service_account, trainer_container, weight_sync_addr
from ..failures import Failure, attempt_failure, true_condition
from .base import (Backend, Context, Finish, Observed, Plan, deadline_message, deadline_passed, decide_failure,
                   pods_phase, workload_kind)

NEEDS = BACKENDS["JobSet"]
JOBSET_API_VERSION = NEEDS.api_version
BY_JOBSET = " by the JobSet's failure policy"
PERMANENT_RULE = "permanentExitCode"
DISRUPTION_RULE = "disruption"


def jobset_rollout_endpoints(job: RLHFJob) -> list[str]:
    """Job i of replicated job `rollout`, its pod 0, in the JobSet's subdomain (none for
    trainer-only jobs)."""
    if job.spec.trainer_pods_only:
        return []
    js, ns = jobset_name(job.metadata.name), namespace_of(job)
    return [f"http://{js}-{RJOB_ROLLOUT}-{i}-0.{js}.{ns}.svc:{contract.ROLLOUT_PORT}"
            for i in range(job.spec.rollout.replicas)]


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
    trainer = trainer_container(job, settings, rollout_endpoints=jobset_rollout_endpoints(job),
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
        "kind": NEEDS.backend,
        "metadata": metadata(job, name, job_labels(job)),
        "spec": spec,
    }


class JobSetBackend(Backend):
    """JobSet restarts its jobs (failure policy) and ends in Completed or Failed; the job's
    phase, restarts and messages are read from it and its pods."""

    needs = NEEDS
    workload = workload_kind(NEEDS, "jobset", jobset_name)
    kinds = (workload,)
    done_condition = "Completed"
    restarts_itself = True
    own_rollout_service = False  # JobSet makes the pods' headless Service itself

    def rollout_endpoints(self, job: RLHFJob) -> list[str]:
        return jobset_rollout_endpoints(job)

    def trainer_rank0(self, job: RLHFJob) -> dict[str, str]:  # pod 0 of the trainer's (only) Job
        return {JOBSET_NAME_LABEL: jobset_name(job.metadata.name), JOBSET_RJOB_LABEL: RJOB_TRAINER,
                COMPLETION_INDEX_LABEL: "0"}

    def build(self, job: RLHFJob, attempt: int, settings: PodSettings) -> list[dict[str, Any]]:
        return [build_jobset(job, settings)]  # the one JobSet, whatever the attempt

    def plan(self, job: RLHFJob, observed: Observed, c: Context, now: datetime, node_lost_after: timedelta,
             finish: Finish) -> Plan:
        kind, js = self.name, c.current.get(self.name)
        if job.spec.suspend:  # JobSet's own suspend: its jobs' pods go, the JobSet and its restart count stay
            return finish("Suspended", "Suspended", "spec.suspend is true: pods deleted, checkpoints kept",
                          support=True, create=True)
        if deadline_passed(job, c.meta, c.conds, now):
            return finish("Failed", "DeadlineExceeded", deadline_message(job), delete=[kind] if js else [])
        if js is None:
            other = observed.jobset
            if other is not None:  # of an earlier job of the same name, or being deleted
                return finish("Pending", "WaitingForOldPods", "waiting for the JobSet of an earlier run to be deleted",
                              support=True, delete=[] if other["metadata"].get("deletionTimestamp") else [kind])
            return finish("Pending", "CreatingPods", "creating the JobSet", support=True, create=True)
        return self._plan_running(job, js, c, finish)

    @staticmethod
    def _plan_running(job: RLHFJob, js: dict[str, Any], c: Context, finish: Finish) -> Plan:
        st = js.get("status") or {}
        js_restarts = int(st.get("restarts") or 0)
        counted = int(st.get("restartsCountTowardsMax", js_restarts) or 0)  # RestartJobSetAndIgnoreMaxRestarts: not
        max_restarts = js["spec"].get("failurePolicy", {}).get("maxRestarts", 0)

        def failure_of(attempts: range) -> Failure | None:
            return attempt_failure([p for p in c.ours if attempt_of(p) in attempts])

        if true_condition(js, "Completed"):
            return finish("Succeeded", "TrainerSucceeded", "the trainer finished every step", restarts_now=js_restarts)
        if failed := true_condition(js, "Failed"):
            failure = failure_of(range(js_restarts, js_restarts + 1))
            what = failure.describe() if failure else (failed.get("message") or "the JobSet failed")
            if failed.get("reason") == "FailJobSetFailurePolicyAction" or (failure and failure.permanent):
                return finish("Failed", "PermanentError", what, restarts_now=js_restarts)
            if failed.get("reason") == "ReachedMaxRestarts":
                return finish("Failed", "RestartLimitExceeded",
                              f"{what}; no restarts left (runPolicy.maxRestarts={max_restarts})", restarts_now=js_restarts)
            return finish("Failed", failed.get("reason") or "JobSetFailed", what, restarts_now=js_restarts)
        if js_restarts > c.restarts:  # the JobSet restarted: report its decision
            failure = failure_of(range(c.restarts, js_restarts))
            disrupted = failure is not None and failure.disrupted
            return decide_failure(finish, failure.describe() if failure else "a pod failed", permanent=False,
                                  disrupted=disrupted, spent=counted if disrupted else counted - 1,
                                  max_restarts=max_restarts, number=js_restarts, by=BY_JOBSET, decided=True,
                                  restart={"support": True, "create": True, "restarts_now": js_restarts,
                                           "disruptions_now": js_restarts - counted})
        restarting = c.conds.get("Restarting", {})
        if c.restarts > js_restarts:  # announced below; the JobSet has not recreated its jobs yet
            return finish("Restarting", restarting.get("reason", "PodFailed"), restarting.get("message", ""),
                          support=True, create=True)
        # A pod of the current attempt failed and the JobSet has not acted yet: its failure
        # policy (which we wrote) decides exactly as decide_failure does, so the status says so
        # at once instead of after the Job and JobSet controllers have caught up (seconds under load).
        failure = failure_of(range(c.restarts, c.restarts + 1))
        if failure is not None and failure.final:  # a pod still being evicted: its Job decides once it has failed
            return decide_failure(finish, failure.describe(), permanent=failure.permanent, disrupted=failure.disrupted,
                                  spent=counted, max_restarts=max_restarts, number=c.restarts + 1, by=BY_JOBSET,
                                  restart={"support": True, "create": True, "restart": True,
                                           "disrupted": failure.disrupted})
        if js["spec"].get("suspend"):
            return finish("Pending", "JobSetSuspended",
                          "the JobSet is suspended (waiting for admission, e.g. by Kueue)", support=True, create=True)
        return pods_phase(job, c.ours, c.restarts, True, finish)


BACKEND = JobSetBackend()
