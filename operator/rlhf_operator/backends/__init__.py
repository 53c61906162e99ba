"""The backend seam: ONE module per value of `spec.backend` (pytorchjob.py, jobset.py,
trainjob.py), each holding its workload's builder, its plan of the job's phase and how its
workload's state is read, over base.py (the observed state, the plan, the one restart
decision). `name_of` and `of_job` are the one place that reads `spec.backend` and picks; nothing
else in the operator names a backend kind (tests/unit/test_backend_seam.py).

Also here, since they differ by backend: the job's support children (`build_support`), its
workloads of one attempt (`build_workloads`), `job_settings` (what the backend cannot carry
refuses the job) and `build_children` (the whole desired state of one attempt).
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import RLHFJob, resolve_backend

from ..builders.access import build_role, build_role_binding, build_service_account
from ..builders.config import build_config_map
from ..builders.judge import build_judge
from ..builders.meta import rollout_name
from ..builders.pods import PodSettings
from ..builders.sandbox import build_sandbox
from ..builders.services import build_network_policy, build_rollout_service, build_weight_sync_service
from ..builders.workloads import rollout_endpoints as statefulset_endpoints
from . import jobset, pytorchjob, trainjob
from .base import PODS, Backend, ChildKind, Observed

BACKENDS: dict[str, Backend] = {b.name: b for b in (pytorchjob.BACKEND, jobset.BACKEND, trainjob.BACKEND)}
CHILD_KINDS: tuple[ChildKind, ...] = (PODS, *dict.fromkeys(ck for b in BACKENDS.values() for ck in b.kinds))
"""Every kind of child whose state a reconcile reads (a new backend's workload: its module's `kinds`)."""
WORKLOAD_KINDS = tuple(ck.kind for ck in CHILD_KINDS if ck.name is not None)


def name_of(body: dict[str, Any]) -> str:
    """THE reading of `spec.backend`, from the RLHFJob as the API server holds it: its value,
    or when unset the default for the job (its Kueue queue label picks JobSet); a value no
    backend has stays as it is (a job that does not validate: only its pods are read)."""
    return resolve_backend((body.get("spec") or {}).get("backend"), (body.get("metadata") or {}).get("labels") or {})


def of_job(job: RLHFJob) -> Backend:
    """The backend of a validated job (its model resolved `spec.backend`'s default)."""
    return BACKENDS[resolve_backend(job.spec.backend, job.metadata.labels)]


def kinds_of(backend: str) -> tuple[ChildKind, ...]:
    """What a reconcile reads of a job of `backend` (a `name_of`): its pods and its workloads."""
    return (PODS, *(BACKENDS[backend].kinds if backend in BACKENDS else ()))


def adopt(kube: Any, observed: Observed, namespace: str, name: str, backend: str) -> Observed:
    """`Backend.adopt` of `backend` (a `name_of`)."""
    return BACKENDS[backend].adopt(kube, observed, namespace, name) if backend in BACKENDS else observed


def workloads_of(observed: Observed) -> dict[str, dict[str, Any] | None]:
    """The observed workloads by kind (None: not there, or not read for this backend)."""
    return {ck.kind: getattr(observed, ck.field) for ck in CHILD_KINDS if ck.name is not None}


def rollout_endpoints(job: RLHFJob) -> list[str]:
    """Base URLs of the rollout servers (the StatefulSet's, unless the backend runs them)."""
    own = of_job(job).rollout_endpoints(job)
    return statefulset_endpoints(job) if own is None else own


def build_support(job: RLHFJob, settings: PodSettings | None = None) -> list[dict[str, Any]]:
    """Children that live as long as the job (not restarted): config, identity, network;
    for `method: rl` also the rollout and weight-sync services (and the code sandbox, and the
    judge servers, which mount the volumes of `settings`)."""
    s, backend = job.spec, of_job(job)
    trainer_sa = s.trainer.pod.over(s.pod).service_account_annotations
    common = [build_config_map(job),
              build_service_account(job, annotations=trainer_sa, pull_secrets=backend.pull_secrets(job)),
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
        *([build_rollout_service(job)] if backend.own_rollout_service and not colocated else []),
        *([] if colocated else [build_weight_sync_service(job, backend.trainer_rank0(job))]),
        build_network_policy(job),
        *build_sandbox(job),  # reward.type code: the sandbox service, out of the trainer's pod
        *build_judge(job, settings if settings is not None else PodSettings.from_job(job)),  # reward.type judge
    ]


def build_workloads(job: RLHFJob, attempt: int, settings: PodSettings) -> list[dict[str, Any]]:
    """The pods' owners for one attempt (the backend's `build`)."""
    return of_job(job).build(job, attempt, settings)


def job_settings(job: RLHFJob, *, allow_host_path: bool = False) -> PodSettings:
    """`PodSettings.from_job`, and what the backend's workload cannot carry (a
    PodSettingsError, e.g. TrainJobError: the job is refused before any child is built).
    `allow_host_path`: the operator is installed with `security.allowHostPath`; otherwise a
    `hostPath` volume in `spec.pod` is a PodSettingsError naming it."""
    settings = PodSettings.from_job(job, allow_host_path=allow_host_path)
    of_job(job).check(job, settings)
    return settings


def build_children(job: RLHFJob, attempt: int, settings: PodSettings | None = None, *,
                   allow_host_path: bool = False) -> list[dict[str, Any]]:
    settings = settings if settings is not None else job_settings(job, allow_host_path=allow_host_path)
    return build_support(job, settings) + build_workloads(job, attempt, settings)


__all__ = ["BACKENDS", "CHILD_KINDS", "PODS", "WORKLOAD_KINDS", "Backend", "ChildKind", "Observed", "adopt", "kinds_of", "name_of",
           "build_children", "build_support", "build_workloads", "job_settings", "of_job", "rollout_endpoints",
           "workloads_of"]
