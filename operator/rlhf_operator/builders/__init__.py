"""PURE builders: an RLHFJob (with its uid) -> the manifests (dicts) of its children.

No API calls here; kube.py applies what these return (server-side apply), handlers.py
decides when. `build_children` is the whole desired state of one attempt.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import RLHFJob
from .access import build_role, build_role_binding, build_service_account
from .config import build_config_map, trainer_config
from .meta import (
    LABEL_ATTEMPT, LABEL_JOB, LABEL_JOB_UID, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, config_map_name,
    network_policy_name, rollout_name, trainer_name, weight_sync_name,
)
from .pods import POD_SETTINGS_ANNOTATION, PodSettings, PodSettingsError
from .sandbox import build_sandbox, wants_sandbox
from .judge import build_judge
from .services import build_network_policy, build_rollout_service, build_weight_sync_service
from .jobset import build_jobset
from .lws import build_rollout_lws, uses_lws
from .trainjob import TrainJobError, build_trainjob, check_trainjob
from .workloads import build_rollout_statefulset, build_trainer_pytorchjob, rollout_endpoints, weight_sync_addr

WORKLOAD_KINDS = ("StatefulSet", "PyTorchJob", "JobSet", "TrainJob", "LeaderWorkerSet")


def build_support(job: RLHFJob, settings: PodSettings | None = None) -> list[dict[str, Any]]:
    """Children that live as long as the job (not restarted): config, identity, network;
    for `method: rl` also the rollout and weight-sync services (and the code sandbox, and the
    judge servers, which mount the volumes of `settings`)."""
    s = job.spec
    trainer_sa = s.trainer.pod.over(s.pod).service_account_annotations
    # pull secrets on the trainer's ServiceAccount (a TrainJob's pods take them from it)
    pulls = s.pod.image_pull_secrets if s.backend == "TrainJob" else ()
    common = [build_config_map(job), build_service_account(job, annotations=trainer_sa, pull_secrets=pulls),
              build_role(job),
              build_role_binding(job)]
    if s.offline:  # sft, rm, dpo: the trainer alone
        return [*common, build_network_policy(job)]
    colocated = s.trainer_pods_only  # the servers run in the trainer's pods, on loopback
    rollout_sa = s.rollout.pod.over(s.pod).service_account_annotations
    return [
        *common,
        *([build_service_account(job, rollout_name(job.metadata.name), rollout_sa)] if rollout_sa and not colocated
          else []),
        # backend JobSet: JobSet makes the pods' headless Service itself
        *([build_rollout_service(job)] if job.spec.backend != "JobSet" and not colocated else []),
        *([] if colocated else [build_weight_sync_service(job)]),
        build_network_policy(job),
        *build_sandbox(job),  # reward.type code: the sandbox service, out of the trainer's pod
        *build_judge(job, settings if settings is not None else PodSettings.from_job(job)),  # reward.type judge
    ]


def build_workloads(job: RLHFJob, attempt: int, settings: PodSettings) -> list[dict[str, Any]]:
    """The pods' owners for one attempt: rollout StatefulSet first (servers load the model
    while the trainer starts), then the trainer PyTorchJob; offline methods (sft, rm, dpo)
    and colocated placement only the PyTorchJob. Backend JobSet: the one JobSet, whatever the attempt (JobSet
    restarts its own jobs)."""
    if job.spec.backend == "JobSet":
        return [build_jobset(job, settings)]
    build_trainer = build_trainjob if job.spec.backend == "TrainJob" else build_trainer_pytorchjob
    if job.spec.trainer_pods_only:  # offline, or colocated: no rollout StatefulSet
        return [build_trainer(job, attempt, settings)]
    build_rollout = build_rollout_lws if uses_lws(job) else build_rollout_statefulset  # rollout.nodesPerServer > 1
    return [build_rollout(job, attempt, settings), build_trainer(job, attempt, settings)]


def job_settings(job: RLHFJob, *, allow_host_path: bool = False) -> PodSettings:
    """`PodSettings.from_job`, and for backend TrainJob what a Trainer v2.3 TrainJob cannot carry
    (TrainJobError, a PodSettingsError: the job is refused before any child is built).
    `allow_host_path`: the operator is installed with `security.allowHostPath`; otherwise a
    `hostPath` volume in `spec.pod` is a PodSettingsError naming it."""
    settings = PodSettings.from_job(job, allow_host_path=allow_host_path)
    if job.spec.backend == "TrainJob":
        check_trainjob(job, settings)
    return settings


def build_children(job: RLHFJob, attempt: int, settings: PodSettings | None = None, *,
                   allow_host_path: bool = False) -> list[dict[str, Any]]:
    settings = settings if settings is not None else job_settings(job, allow_host_path=allow_host_path)
    return build_support(job, settings) + build_workloads(job, attempt, settings)


__all__ = [
    "LABEL_ATTEMPT", "LABEL_JOB", "LABEL_JOB_UID", "LABEL_ROLE", "POD_SETTINGS_ANNOTATION", "ROLE_ROLLOUT",
    "ROLE_TRAINER", "WORKLOAD_KINDS", "PodSettings", "PodSettingsError", "build_children", "build_support",
    "build_jobset", "build_sandbox", "build_trainjob", "TrainJobError", "job_settings", "build_workloads", "config_map_name", "trainer_config", "network_policy_name",
    "rollout_endpoints", "rollout_name", "trainer_name", "weight_sync_addr", "weight_sync_name", "wants_sandbox",
]
