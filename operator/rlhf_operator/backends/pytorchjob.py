"""`spec.backend: PyTorchJob` (the default without Kueue): the trainer as a Kubeflow
training-operator PyTorchJob (Master + `numNodes - 1` Workers, restartPolicy Never,
backoffLimit 0: restarts are ours, whole-job), container `pytorch` as the
training-operator expects (torchrun reads the PET_* variables it sets); the rollout
servers as our StatefulSet (builders/workloads.py) behind its headless Service.

The plan (`WholeJobRestarts`, TrainJob's too): the operator restarts the WHOLE job itself.
When a pod of the current attempt fails, the restart decision (base.decide_failure) is
written to the status, the workloads of attempt N are deleted, and those of N + 1 are
created only once no pod of the job is left. Succeeded dominates: once the trainer has
finished (its workload's done condition), a rollout server dying is no reason to restart.
"""

from __future__ import annotations

from abc import abstractmethod
from datetime import datetime, timedelta
from typing import Any

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BACKENDS

from ..builders.meta import LABEL_ATTEMPT, ROLE_TRAINER, attempt_of, job_labels, metadata, pod_labels, trainer_name
from ..builders.pods import PodSettings, pod_spec, template_metadata
from ..builders.lws import build_rollout_lws, uses_lws
from ..builders.storage import with_storage
from ..builders.workloads import build_rollout_statefulset, rollout_endpoints, trainer_container, weight_sync_addr
from ..failures import Failure, attempt_failure, left_to_kubelet, lost_pod, parse_time, true_condition
from ..lws_status import ROLLOUT_KINDS, left_to_lws, rollout_kind
from .base import (ROLLOUT_LWS, ROLLOUT_STATEFULSET, Backend, Context, Finish, Observed, Plan, deadline_message, deadline_passed,
                   decide_failure, pods_phase, workload_kind)

NEEDS = BACKENDS["PyTorchJob"]
# The training-operator deletes a failed trainer pod at once; its exit code reaches us
# through the pod's watch events. A PyTorchJob marked Failed with no failed pod in sight
# is therefore given this long for that evidence before it counts as a retryable failure.
EVIDENCE_GRACE = timedelta(seconds=10)


def build_trainer_pytorchjob(job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
    t = job.spec.trainer
    # container `pytorch`: the training-operator injects PET_* / MASTER_* into it
    container = trainer_container(job, settings, rollout_endpoints=rollout_endpoints(job),
                                  weight_sync_addr=weight_sync_addr(job))
    template = {
        "metadata": template_metadata(pod_labels(job, ROLE_TRAINER, attempt), settings.role(ROLE_TRAINER)),
        "spec": with_storage(job, settings, pod_spec(job, settings, [container], role=ROLE_TRAINER, restart_policy="Never",
                                                     service_account=trainer_name(job.metadata.name)),
                             trainer=True),
    }
    replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template}}
    if t.num_nodes > 1:
        replicas["Worker"] = {"replicas": t.num_nodes - 1, "restartPolicy": "Never", "template": template}
    return {
        "apiVersion": NEEDS.api_version,
        "kind": NEEDS.backend,
        "metadata": metadata(job, trainer_name(job.metadata.name),
                             {**job_labels(job), LABEL_ATTEMPT: str(attempt)}),
        "spec": {
            # Failed pods stay for their logs; running ones go when the PyTorchJob ends.
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "nprocPerNode": str(t.nproc_per_node),
            "pytorchReplicaSpecs": replicas,
        },
    }


class WholeJobRestarts(Backend):
    """A trainer workload of one attempt beside the rollout StatefulSet; the operator
    restarts the whole job (both deleted, every pod gone, attempt + 1)."""

    def build(self, job: RLHFJob, attempt: int, settings: PodSettings) -> list[dict[str, Any]]:
        """Rollout StatefulSet first (servers load the model while the trainer starts), then
        the trainer; offline methods (sft, rm, dpo) and colocated placement the trainer only."""
        trainer = self.build_trainer(job, attempt, settings)
        if job.spec.trainer_pods_only:  # offline, or colocated: no rollout StatefulSet
            return [trainer]
        build_rollout = build_rollout_lws if uses_lws(job) else build_rollout_statefulset  # rollout.nodesPerServer > 1
        return [build_rollout(job, attempt, settings), trainer]

    @abstractmethod
    def build_trainer(self, job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
        """The trainer's workload of attempt `attempt` (the PyTorchJob, the TrainJob)."""

    def trainer_failure(self, observed: Observed, c: Context, now: datetime, node_lost_after: timedelta,
                        replacements: int = 0) -> Failure | None:
        """The first failure of the current attempt (a server's, once the trainer is done, does
        not count), or a Failed trainer workload whose failed pod has not been seen in time."""
        kind = self.name
        # an LWS group's pod that failed is the LWS controller's to recreate (lws_status.left_to_lws), a
        # StatefulSet's restarted container the kubelet's with rollout.maxServerReplacements (failures.left_to_kubelet)
        failure = attempt_failure([p for p in c.ours if attempt_of(p) == c.restarts and not left_to_lws(p)
                                   and not left_to_kubelet(p, replacements)],
                                  lambda pod: lost_pod(pod, observed.nodes_not_ready, now, node_lost_after))
        failed = true_condition(c.current.get(kind), "Failed")
        if failed and now < (parse_time(failed.get("lastTransitionTime")) or now) + EVIDENCE_GRACE:
            failed = None  # wait a moment for the failed pod's exit code
        if failure is None and failed:
            failure = Failure(c.current[kind]["metadata"]["name"], ROLE_TRAINER, None, None,
                              failed.get("reason") or f"{kind}Failed", failed.get("message") or "")
        return failure

    def plan(self, job: RLHFJob, observed: Observed, c: Context, now: datetime, node_lost_after: timedelta,
             finish: Finish) -> Plan:
        kind = self.name
        if job.spec.suspend:
            return finish("Suspended", "Suspended", "spec.suspend is true: pods deleted, checkpoints kept",
                          support=True, delete=list(c.live))
        # Succeeded dominates: a finished trainer is never restarted, whatever the servers do.
        if true_condition(c.current.get(kind), self.done_condition):
            return finish("Succeeded", "TrainerSucceeded", "the trainer finished every step",
                          delete=[k for k in c.live if k in ROLLOUT_KINDS])
        failure = self.trainer_failure(observed, c, now, node_lost_after, job.spec.rollout.max_server_replacements)
        if failure is not None:
            # Keep a failed trainer's workload (its pods' logs); stop everything else.
            stop = [k for k in c.live if not (k == kind and failure.role == ROLE_TRAINER)]
            return decide_failure(finish, failure.describe(), permanent=failure.permanent, disrupted=failure.disrupted,
                                  spent=c.restarts - c.disruptions, max_restarts=job.spec.run_policy.max_restarts,
                                  number=c.restarts + 1, stop={"delete": stop},
                                  restart={"support": True, "delete": list(c.live), "restart": True,
                                           "disrupted": failure.disrupted})
        if deadline_passed(job, c.meta, c.conds, now):
            return finish("Failed", "DeadlineExceeded", deadline_message(job), delete=list(c.live))
        # Workloads of an earlier attempt (or of an earlier job of the same name) still exist,
        # or their pods do: delete, and create the new attempt only once no pod is left.
        leftovers = [p for p in observed.pods if p not in c.ours or attempt_of(p) != c.restarts]
        if c.stale or (not c.current and leftovers):
            restarting = c.conds.get("Restarting", {})
            if restarting.get("status") == "True":
                return finish("Restarting", restarting.get("reason", "PodFailed"), restarting.get("message", ""),
                              support=True, delete=c.stale)
            return finish("Pending", "WaitingForOldPods",
                          f"waiting for {len(leftovers)} pod(s) of an earlier run to be deleted", support=True,
                          delete=c.stale)
        required = [kind] if job.spec.trainer_pods_only else [rollout_kind(job), kind]
        return pods_phase(job, c.ours, c.restarts, all(k in c.current for k in required), finish)


class PyTorchJobBackend(WholeJobRestarts):
    needs = NEEDS
    workload = workload_kind(NEEDS, "pytorchjob", trainer_name)
    kinds = (ROLLOUT_STATEFULSET, ROLLOUT_LWS, workload)
    done_condition = "Succeeded"

    def build_trainer(self, job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
        return build_trainer_pytorchjob(job, attempt, settings)

    def trainer_rank0(self, job: RLHFJob) -> dict[str, str]:  # the master pod
        return {
            "training.kubeflow.org/job-name": trainer_name(job.metadata.name),
            "training.kubeflow.org/replica-type": "master",
            "training.kubeflow.org/replica-index": "0",
        }


BACKEND = PyTorchJobBackend()
