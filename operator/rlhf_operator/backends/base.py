"""What every backend shares: the observed state of a job's children (`Observed`), the plan
a reconcile carries out (`Plan`), the job's status as one reconcile sees it (`Context`), the
ONE restart decision (`decide_failure`), the phase read from the pods (`pods_phase`), and
`Backend`, the seam each backend module (pytorchjob.py, jobset.py, trainjob.py) fills in:
which workloads it reads, how it builds them, how it plans the job's phase from them.

PURE: no API calls (a backend's `adopt` gets the caller's `Kube` to make its own).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BackendNeeds

from ..builders.lws import LWS_API_VERSION
from ..builders.meta import LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, attempt_of, rollout_name
from ..builders.pods import PodSettings
from ..failures import Failure, labels, parse_time, pod_ready, true_condition, unschedulable
from ..lws_status import servers


@dataclass(frozen=True)
class ChildKind:
    """A kind of child the operator reads back: kopf watches it (the job's label, filtered
    by the API server) into an in-memory index; `Kube.observe` reads it with a GET (a LIST
    for pods) where there is no index."""

    kind: str
    group: str  # "" for the core group
    version: str
    plural: str
    field: str  # `Observed`'s attribute; "pods": every object of the job, else the one named `name(job)`
    name: Callable[[str], str] | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def workload_kind(needs: BackendNeeds, field_: str, name: Callable[[str], str]) -> ChildKind:
    """A backend's own workload, read as its CRD (rlhf_contract.backends) names it."""
    return ChildKind(needs.backend, needs.group, needs.version, needs.plural, field_, name)


PODS = ChildKind("Pod", "", "v1", "pods", "pods")
ROLLOUT_STATEFULSET = ChildKind("StatefulSet", "apps", "v1", "statefulsets", "statefulset", rollout_name)
"""The rollout servers' StatefulSet (backends whose servers are not inside the trainer's workload)."""
ROLLOUT_LWS = ChildKind("LeaderWorkerSet", *LWS_API_VERSION.split("/"), "leaderworkersets", "leaderworkerset",
                        rollout_name)
"""`rollout.nodesPerServer` > 1: the rollout servers as LeaderWorkerSet groups (builders/lws.py)."""


@dataclass
class Observed:
    """What exists of the job's children (as the API returned them)."""

    statefulset: dict[str, Any] | None = None
    pytorchjob: dict[str, Any] | None = None
    jobset: dict[str, Any] | None = None
    """Backend JobSet: the job's JobSet (then statefulset and pytorchjob are None)."""
    trainjob: dict[str, Any] | None = None  # backend TrainJob: in place of the PyTorchJob
    leaderworkerset: dict[str, Any] | None = None  # rollout.nodesPerServer > 1: in place of the StatefulSet
    pods: list[dict[str, Any]] = field(default_factory=list)
    nodes_not_ready: dict[str, datetime] = field(default_factory=dict)
    """Nodes of the job's pods that are not Ready: name -> since when (the Ready
    condition's lastTransitionTime)."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Plan:
    status: dict[str, Any]
    """The complete new status (camelCase)."""
    apply_support: bool = False
    """Apply the long-lived children (config, services, RBAC, network policy)."""
    create_workloads: bool = False
    """Apply the workloads of attempt `status.restarts` (the backend's `build`)."""
    delete: list[str] = field(default_factory=list)
    """Kinds of workload to delete ("StatefulSet", the backend's kind)."""
    delete_job: bool = False
    """ttlSecondsAfterFinished has passed: delete the RLHFJob itself."""
    force_delete: list[str] = field(default_factory=list)
    """Pods to delete with grace period 0: being deleted, on a lost node."""
    events: list[Event] = field(default_factory=list)


Finish = Callable[..., Plan]
"""`finish(phase, reason, message, ...)`: the Plan of a decided phase (status.py)."""


@dataclass
class Context:
    """The job's status and children as one reconcile sees them."""

    meta: dict[str, Any]
    restarts: int
    conds: dict[str, dict[str, Any]]
    prev_phase: str | None
    progress: dict[str, Any]
    ours: list[dict[str, Any]]
    """The job's own pods (by the job's uid)."""
    current: dict[str, dict[str, Any]]
    """The workloads of this attempt, by kind."""
    stale: list[str]
    """Kinds of workload of an earlier attempt (or an earlier job of the same name)."""
    live: dict[str, dict[str, Any]]
    """Every workload not being deleted, by kind."""
    old_status: dict[str, Any] = field(default_factory=dict)
    """The status as read (startTime and completionTime are kept from it)."""

    @property
    def disruptions(self) -> int:
        """Restarts so far that disruptions caused (not counted against maxRestarts)."""
        return int(self.old_status.get("disruptions") or 0)


def decide_failure(finish: Finish, what: str, *, permanent: bool, disrupted: bool, spent: int, max_restarts: int,
                   number: int, by: str = "", stop: dict[str, Any] | None = None,
                   restart: dict[str, Any] | None = None, decided: bool = False) -> Plan:
    """THE restart decision, for every backend: a failure (`what` describes it) is permanent
    -> Failed; a disruption -> a restart not counted against runPolicy.maxRestarts; restarts
    left (`spent` of `max_restarts`) -> restart `number`; else Failed. `by`: who restarts
    (appended to the message: " by the JobSet's failure policy"); `stop`/`restart`: the
    finish arguments of a Failed / Restarting plan (what to delete or create); `decided`:
    the restart already happened (the backend's controller restarted), only report it."""
    stop, restart = stop or {}, restart or {}
    if permanent and not decided:
        return finish("Failed", "PermanentError", what, **stop)
    if disrupted:  # as JobSet's RestartJobSetAndIgnoreMaxRestarts
        return finish("Restarting", "Disrupted",
                      f"{what}; a disruption, not counted against runPolicy.maxRestarts ({spent} of {max_restarts} "
                      f"spent): restart {number}{by}, resuming from the newest checkpoint", **restart)
    if spent >= max_restarts and not decided:
        return finish("Failed", "RestartLimitExceeded",
                      f"{what}; no restarts left (runPolicy.maxRestarts={max_restarts})", **stop)
    return finish("Restarting", "PodFailed",
                  f"{what}; restart {spent + 1} of {max_restarts}{by}, resuming from the newest checkpoint", **restart)


def deadline_passed(job: RLHFJob, meta: dict[str, Any], conds: dict[str, dict[str, Any]], now: datetime) -> bool:
    deadline = job.spec.run_policy.active_deadline_seconds
    if deadline is None:
        return False
    resumed = conds.get("Suspended")
    start = parse_time(meta.get("creationTimestamp")) or now
    if resumed and resumed.get("status") == "False":
        start = max(start, parse_time(resumed.get("lastTransitionTime")) or start)
    return now >= start + timedelta(seconds=deadline)


def deadline_message(job: RLHFJob) -> str:
    return f"ran longer than runPolicy.activeDeadlineSeconds ({job.spec.run_policy.active_deadline_seconds} s)"


def pods_phase(job: RLHFJob, ours: list[dict[str, Any]], attempt: int, workloads_exist: bool, finish: Finish) -> Plan:
    """Pending, Initializing or Running, from the pods of `attempt` (every backend)."""
    if job.spec.trainer_pods_only:  # sft, rm, dpo run the trainer alone; colocated servers are in its pods
        expected = {ROLE_TRAINER: job.spec.trainer.num_nodes}
    else:
        expected = {ROLE_ROLLOUT: job.spec.rollout.replicas, ROLE_TRAINER: job.spec.trainer.num_nodes}
    pods = [p for p in ours if attempt_of(p) == attempt and not p["metadata"].get("deletionTimestamp")]
    # a LeaderWorkerSet group counts as one rollout server (lws_status.servers)
    by_role = {r: servers(job, r, [p for p in pods if labels(p).get(LABEL_ROLE) == r]) for r in expected}
    counts = ", ".join(f"{sum((p.get('status') or {}).get('phase') == 'Running' for p in by_role[r])}/{n} {r}"
                       for r, n in expected.items())
    if not workloads_exist or any(len(by_role[r]) < n for r, n in expected.items()):
        return finish("Pending", "CreatingPods", f"waiting for pods: {counts} running", support=True, create=True)
    if not all(p.get("spec", {}).get("nodeName") for p in pods):
        return finish("Pending", "Unschedulable" if unschedulable(pods) else "Scheduling",
                      f"waiting for pods to be scheduled: {counts} running", support=True, create=True)
    running = all((p.get("status") or {}).get("phase") == "Running" for p in pods)
    ready = all(pod_ready(p) for p in by_role.get(ROLE_ROLLOUT, []))
    if running and ready:
        return finish("Running", "AllPodsRunning",
                      f"{counts} running" + ("" if job.spec.trainer_pods_only else "; rollout servers ready"), support=True,
                      create=True)
    return finish("Initializing", "PodsStarting", f"{counts} running", support=True, create=True)


class Backend(ABC):
    """One value of `spec.backend`. A subclass names its CRD (`needs`), the kinds of child it
    reads (`kinds`: its own workload `workload` among them), the condition of `workload` that
    says the trainer finished, and implements `build` and `plan`."""

    needs: BackendNeeds
    workload: ChildKind
    kinds: tuple[ChildKind, ...]
    """The workloads a reconcile reads for a job of this backend (its pods are always read)."""
    done_condition: str
    restarts_itself: bool = False
    """True: its controller restarts the pods (its workload lives through every attempt)."""
    own_rollout_service: bool = True
    """False: the backend's controller makes the rollout pods' headless Service itself."""

    @property
    def name(self) -> str:
        return self.needs.backend

    @property
    def trigger(self) -> str:
        """The reconcile trigger (metrics label) of a watch event of its workload."""
        return self.workload.field

    def ended(self, observed: Observed) -> bool:
        """Its workload finished, either way (a terminal job keeps a finished one's pods)."""
        obj = getattr(observed, self.workload.field)
        return bool(true_condition(obj, self.done_condition) or true_condition(obj, "Failed"))

    def check(self, job: RLHFJob, settings: PodSettings) -> None:
        """Raise a PodSettingsError for what this backend's workload cannot carry."""

    def pull_secrets(self, job: RLHFJob) -> tuple[Any, ...]:
        """Image pull secrets for the trainer's ServiceAccount (its pods take them from it)."""
        return ()

    def rollout_endpoints(self, job: RLHFJob) -> list[str] | None:
        """The rollout servers' base URLs when not the StatefulSet's (None: the StatefulSet's)."""
        return None

    @abstractmethod
    def trainer_rank0(self, job: RLHFJob) -> dict[str, str]:
        """The label selector of trainer rank 0's pod (the weight-sync Service's)."""

    @abstractmethod
    def build(self, job: RLHFJob, attempt: int, settings: PodSettings) -> list[dict[str, Any]]:
        """The pods' owners of attempt `attempt`."""

    @abstractmethod
    def plan(self, job: RLHFJob, observed: Observed, c: Context, now: datetime, node_lost_after: timedelta,
             finish: Finish) -> Plan:
        """The job's phase and the actions on its workloads (a non-terminal, valid job)."""

    def adopt(self, kube: Any, observed: Observed, namespace: str, name: str) -> Observed:
        """`observed` with pods of the job that its controller made without the job's labels
        (read and labelled through `kube`, the caller's kube.Kube); most backends have none."""
        return observed


__all__ = ["PODS", "ROLLOUT_LWS", "ROLLOUT_STATEFULSET", "Backend", "ChildKind", "Context", "Event", "Failure", "Finish", "Observed",
           "Plan", "deadline_message", "deadline_passed", "decide_failure", "pods_phase", "workload_kind"]
