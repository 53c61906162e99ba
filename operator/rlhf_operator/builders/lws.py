"""Rollout servers larger than one node (`rollout.nodesPerServer` > 1): one LeaderWorkerSet
(leaderworkerset.x-k8s.io/v1, the LWS controller) in place of the rollout StatefulSet.

`rollout.replicas` groups of `nodesPerServer` pods, `tensorParallelSize / nodesPerServer`
GPUs each. The LWS controller names a group's leader `<job>-rollout-<group>` and its workers
`<job>-rollout-<group>-<index>`, and sets LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
LWS_WORKER_INDEX in every container (its api/leaderworkerset/v1); the commands read them
(`contract.multinode_flags`): the leader is vLLM's node rank 0 and serves HTTP, so the trainer's
endpoints, the weight sync's rank offsets and the job's Service stay those of the StatefulSet
(the Service `<job>-rollout` selects the leaders only; LWS makes no Service of its own when one
of its name exists). The workers run `vllm serve --headless`: no HTTP, so no probes; they join
the weight sync through their leader (its engine's workers span the group).

restartPolicy RecreateGroupOnPodRestart: a pod of a group that fails or restarts makes the LWS
controller recreate that whole group (vLLM cannot re-join one node into a running server); the
operator leaves that to it (status.py: an LWS group's failures are not the job's, unless the
exit code is permanent). A spec change never rolls groups under a running trainer: a new
attempt makes a new LeaderWorkerSet, as for the StatefulSet.

Not done: LWS's exclusive topology placement, subgroups and gang scheduling (a group's pods
are scheduled one by one; `rollout.pod` can require a node pool).
"""

from __future__ import annotations

from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from .meta import LABEL_ATTEMPT, ROLE_ROLLOUT, job_labels, metadata, pod_labels, rollout_name
from .pods import PodSettings, container_resources, pod_spec, template_metadata
from .storage import with_storage
from .workloads import rollout_container, rollout_service_account

LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""Labels the LWS controller puts on every pod of a group (the leader's worker index is "0")."""
RESTART_POLICY = "RecreateGroupOnPodRestart"


def uses_lws(job: RLHFJob) -> bool:
    """The job's rollout servers are LeaderWorkerSet groups (a rule keeps these to backends
    PyTorchJob and TrainJob, vLLM, placement separate)."""
    return not job.spec.trainer_pods_only and job.spec.rollout.nodes_per_server > 1


def leader_selector(job: RLHFJob) -> dict[str, str]:
    """What the rollout Service adds to its selector for LWS groups: their leaders only."""
    return {LWS_WORKER_INDEX_LABEL: "0"} if uses_lws(job) else {}


def gpus_per_pod(job: RLHFJob) -> int:
    """Accelerators of each pod of a group (a rule keeps nodesPerServer a divisor of
    tensorParallelSize)."""
    return job.spec.rollout.gpus_per_server // job.spec.rollout.nodes_per_server


def _leader_container(job: RLHFJob, settings: PodSettings) -> dict[str, Any]:
    container = rollout_container(job, settings)
    container["command"] = [*container["command"], *contract.multinode_flags(job.spec, leader=True)]
    container["resources"] = container_resources(gpus_per_pod(job), job.spec.rollout.resources,
                                                 settings.role(ROLE_ROLLOUT))
    container["ports"] = [*container["ports"], {"name": "vllm-master", "containerPort": contract.ROLLOUT_MASTER_PORT,
                                                "protocol": "TCP"}]
    return container


def _worker_container(job: RLHFJob, settings: PodSettings) -> dict[str, Any]:
    """vLLM's headless node: the leader's command with the worker's flags, no HTTP port or probes."""
    container = {k: v for k, v in rollout_container(job, settings).items()
                 if k not in ("ports", "startupProbe", "readinessProbe", "livenessProbe")}
    container["command"] = [*container["command"], *contract.multinode_flags(job.spec, leader=False)]
    container["resources"] = container_resources(gpus_per_pod(job), job.spec.rollout.resources,
                                                 settings.role(ROLE_ROLLOUT))
    return container


def _template(job: RLHFJob, attempt: int, settings: PodSettings, container: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": template_metadata(pod_labels(job, ROLE_ROLLOUT, attempt), settings.role(ROLE_ROLLOUT)),
        "spec": with_storage(job, settings, pod_spec(job, settings, [container], role=ROLE_ROLLOUT,
                                                     restart_policy="Always",
                                                     service_account=rollout_service_account(job, settings),
                                                     automount_token=False), trainer=False),
    }


def build_rollout_lws(job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
    """The rollout servers of attempt `attempt` as one LeaderWorkerSet named as the StatefulSet."""
    r = job.spec.rollout
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": metadata(job, rollout_name(job.metadata.name), {**job_labels(job), LABEL_ATTEMPT: str(attempt)}),
        "spec": {
            "replicas": r.replicas,
            # the workers start with their leader: vLLM's rendezvous waits for all nodes
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": r.nodes_per_server,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": _template(job, attempt, settings, _leader_container(job, settings)),
                "workerTemplate": _template(job, attempt, settings, _worker_container(job, settings)),
            },
        },
    }
