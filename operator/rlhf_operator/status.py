"""PURE status computation: (job, observed children, now) -> the job's new status and what
to do about the children. No API calls; handlers.py carries the plan out.

One restart domain. The attempt number is `status.restarts`; the children of attempt N
carry `rlhf.dev/attempt: N`. When a pod of the current attempt fails:
- its exit code is permanent (`rlhf_contract.exit_codes.PERMANENT`) -> Failed at once;
- restarts < runPolicy.maxRestarts -> restarts + 1, phase Restarting: the workloads of
  attempt N are deleted, and those of N + 1 are created only once no pod of the job is
  left (`Plan.create_workloads`);
- otherwise -> Failed, naming the pod and its exit code.
The decision is written to the status before anything is deleted, so an operator killed
at any point resumes the same restart. Succeeded and Failed are terminal: nothing is
created again, whatever happens to the children. Succeeded dominates: once the trainer
has finished (its PyTorchJob Succeeded, or a trainer pod of the attempt Succeeded), a
rollout server dying is no reason to restart.

Lost nodes: a pod on a node that has not been Ready for `node_lost_after` (the node's
Ready condition is False or Unknown; its kubelet is gone) counts as failed, and any pod
of the job still there once it is being deleted is force-deleted (`Plan.force_delete`),
as the pod garbage collector does for out-of-service nodes. Without that a restart
would wait for ever: an API server keeps a Terminating pod until its kubelet confirms.

Phases: Pending (children or pods not yet scheduled), Initializing (pods placed, not all
running and ready), Running, Restarting, Suspended, Succeeded, Failed. Conditions, each
set by its own function: conditions.py. What pods and workloads say (failures, lost
nodes, readiness): failures.py.

Simplifications: a rollout pod that the StatefulSet replaced while the operator was down
is noticed only through its containers' restart counts; `activeDeadlineSeconds` counts
from the job's creation or its last resume (the status has no startTime field).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

from rlhf_contract.api.models import RLHFJob

from .builders.meta import LABEL_JOB_UID, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, attempt_of
from .conditions import CONDITION_TYPES, conditions_by_type, set_conditions
from .failures import (NODE_LOST_AFTER, Failure, attempt_failure, labels, lost_pod,
                       parse_time, pod_failure, pod_ready, true_condition, ts, unschedulable)
from .lws_status import ROLLOUT_KINDS, left_to_lws, rollout_kind, servers
from .ownership import controlled_by

__all__ = ["NODE_LOST_AFTER", "Event", "Failure", "Observed", "Plan", "attempt_failure",
           "lost_pod", "parse_time", "plan", "pod_failure", "set_conditions"]

TERMINAL = ("Succeeded", "Failed")
TERMINAL_GRACE = timedelta(seconds=60)
# The training-operator deletes a failed trainer pod at once; its exit code reaches us
# through the pod's watch events. A PyTorchJob marked Failed with no failed pod in sight
# is therefore given this long for that evidence before it counts as a retryable failure.
EVIDENCE_GRACE = timedelta(seconds=10)

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
    """Apply the StatefulSet and PyTorchJob of attempt `status.restarts`."""
    delete: list[str] = field(default_factory=list)
    """Kinds of workload to delete ("StatefulSet", "PyTorchJob")."""
    delete_job: bool = False
    """ttlSecondsAfterFinished has passed: delete the RLHFJob itself."""
    force_delete: list[str] = field(default_factory=list)
    """Pods to delete with grace period 0: being deleted, on a lost node."""
    events: list[Event] = field(default_factory=list)


# ---------------------------------------------------------------- the plan

def plan(body: dict[str, Any], job: RLHFJob | None, observed: Observed, now: datetime,
         invalid: str | None = None, node_lost_after: timedelta = NODE_LOST_AFTER) -> Plan:
    """Decide the job's status and the actions on its children.

    `body` is the RLHFJob as read from the API server (metadata and current status);
    `job` its validated model, or None with `invalid` saying why it does not validate.
    """
    result = _plan(body, job, observed, now, invalid, node_lost_after)
    result.force_delete = sorted(
        p["metadata"]["name"] for p in observed.pods
        if p["metadata"].get("deletionTimestamp") and lost_pod(p, observed.nodes_not_ready, now, node_lost_after))
    return result


@dataclass
class _Context:
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


def _context(body: dict[str, Any], job: RLHFJob | None, observed: Observed) -> _Context:
    meta = body.get("metadata", {})
    uid = meta.get("uid", "")
    old = copy.deepcopy(body.get("status") or {})
    restarts = int(old.get("restarts") or 0)
    progress = dict(old.get("progress") or {})
    if job is not None and not progress.get("totalSteps"):
        progress["totalSteps"] = job.spec.schedule.total_steps
    workloads = {"StatefulSet": observed.statefulset, "PyTorchJob": observed.pytorchjob, "JobSet": observed.jobset,
                 "TrainJob": observed.trainjob, "LeaderWorkerSet": observed.leaderworkerset}
    # A JobSet lives through every attempt (it restarts its own jobs).
    current = {k: w for k, w in workloads.items() if w is not None and controlled_by(w, uid)
               and (k == "JobSet" or attempt_of(w) == restarts) and not w["metadata"].get("deletionTimestamp")}
    stale = [k for k, w in workloads.items() if w is not None and k not in current
             and not w["metadata"].get("deletionTimestamp")]
    live = {k: w for k, w in workloads.items() if w is not None and not w["metadata"].get("deletionTimestamp")}
    return _Context(meta, restarts, conditions_by_type(old), old.get("phase"), progress,
                    [p for p in observed.pods if labels(p).get(LABEL_JOB_UID) == uid], current, stale, live, old)


def _finisher(c: _Context, now: datetime) -> Callable[..., Plan]:
    """`finish(phase, reason, message, ...)`: the Plan of a decided phase (conditions,
    status, events and actions)."""

    def finish(phase: str, reason: str, message: str, *, create: bool = False, support: bool = False,
               delete: list[str] | None = None, delete_job: bool = False, restart: bool = False,
               restarts_now: int | None = None, disrupted: bool = False, disruptions_now: int | None = None) -> Plan:
        set_conditions(c.conds, phase, reason, message, now, c.meta.get("generation"))
        status = {
            "phase": phase,
            "conditions": [c.conds[t] for t in CONDITION_TYPES if t in c.conds],
            "observedGeneration": c.meta.get("generation"),
            "restarts": restarts_now if restarts_now is not None else c.restarts + (1 if restart else 0),
            "message": message,
            "progress": c.progress,
        }
        disruptions = disruptions_now if disruptions_now is not None else c.disruptions + (1 if disrupted else 0)
        if disruptions:
            status["disruptions"] = disruptions
        # startTime: when pods were first asked for; completionTime: when it ended (both kept)
        start = c.old_status.get("startTime") or (ts(now) if create else None)
        done = c.old_status.get("completionTime") or (ts(now) if phase in ("Succeeded", "Failed") else None)
        status.update({k: v for k, v in (("startTime", start), ("completionTime", done)) if v})
        events = []
        if phase != c.prev_phase or restart:
            warn = phase in ("Failed", "Restarting")
            events.append(Event("Warning" if warn else "Normal", reason if warn else phase, message))
        return Plan(status, apply_support=support, create_workloads=create, delete=delete or [],
                    delete_job=delete_job, events=events)

    return finish


def _plan(body: dict[str, Any], job: RLHFJob | None, observed: Observed, now: datetime, invalid: str | None,
          node_lost_after: timedelta) -> Plan:
    c = _context(body, job, observed)
    finish = _finisher(c, now)
    if c.prev_phase in TERMINAL:
        return _terminal(job, observed, c, now, finish)
    if job is None:
        return finish("Failed", "InvalidSpec", invalid or "the job does not validate", delete=list(c.live))
    if job.spec.backend == "JobSet":
        return _plan_jobset(job, c.meta, observed, c.ours, c.current, c.restarts, c.conds, now, finish)
    return _plan_pytorchjob(job, observed, c, now, node_lost_after, finish)


def _terminal(job: RLHFJob | None, observed: Observed, c: _Context, now: datetime, finish) -> Plan:
    """Terminal: nothing is created again. The rollout servers go at once; an unfinished
    PyTorchJob after a grace period (a finished one keeps its failed pods for their logs)."""
    cond = c.conds.get(c.prev_phase, {})
    finished = parse_time(cond.get("lastTransitionTime")) or now
    done = any(true_condition(w, t) for w, t in ((observed.pytorchjob, "Succeeded"), (observed.jobset, "Completed"),
                                                  (observed.trainjob, "Complete"))) or any(
        true_condition(w, "Failed") for w in (observed.pytorchjob, observed.jobset, observed.trainjob))
    delete = [k for k in c.live if k in ROLLOUT_KINDS or (not done and now >= finished + TERMINAL_GRACE)]
    ttl = job.spec.run_policy.ttl_seconds_after_finished if job else None
    expired = ttl is not None and now >= finished + timedelta(seconds=ttl)
    return finish(c.prev_phase, cond.get("reason", c.prev_phase), cond.get("message", ""), delete=delete,
                  delete_job=expired)


def _trainer_failure(observed: Observed, c: _Context, now: datetime, node_lost_after: timedelta,
                     kind: str = "PyTorchJob") -> Failure | None:
    """The first failure of the current attempt (a server's, once the trainer is done, does
    not count), or a Failed PyTorchJob (TrainJob) whose failed pod has not been seen in time."""
    failure = attempt_failure([p for p in c.ours if attempt_of(p) == c.restarts and not left_to_lws(p)],
                              lambda pod: lost_pod(pod, observed.nodes_not_ready, now, node_lost_after))
    ptj_failed = true_condition(c.current.get(kind), "Failed")
    if ptj_failed and now < (parse_time(ptj_failed.get("lastTransitionTime")) or now) + EVIDENCE_GRACE:
        ptj_failed = None  # wait a moment for the failed pod's exit code
    if failure is None and ptj_failed:
        failure = Failure(c.current[kind]["metadata"]["name"], ROLE_TRAINER, None, None,
                          ptj_failed.get("reason") or f"{kind}Failed", ptj_failed.get("message") or "")
    return failure


def _plan_pytorchjob(job: RLHFJob, observed: Observed, c: _Context, now: datetime, node_lost_after: timedelta,
                     finish) -> Plan:
    """Backends PyTorchJob and TrainJob (+ StatefulSet): the operator restarts the whole job itself."""
    kind, done = ("TrainJob", "Complete") if job.spec.backend == "TrainJob" else ("PyTorchJob", "Succeeded")
    if job.spec.suspend:
        return finish("Suspended", "Suspended", "spec.suspend is true: pods deleted, checkpoints kept",
                      support=True, delete=list(c.live))
    # Succeeded dominates: a finished trainer is never restarted, whatever the servers do.
    if true_condition(c.current.get(kind), done):
        return finish("Succeeded", "TrainerSucceeded", "the trainer finished every step",
                      delete=[k for k in c.live if k in ROLLOUT_KINDS])
    failure = _trainer_failure(observed, c, now, node_lost_after, kind)
    if failure is not None:
        # Keep a failed trainer's PyTorchJob (its pods' logs); stop everything else.
        stop = [k for k in c.live if not (k == kind and failure.role == ROLE_TRAINER)]
        if failure.permanent:
            return finish("Failed", "PermanentError", failure.describe(), delete=stop)
        max_restarts = job.spec.run_policy.max_restarts
        spent = c.restarts - c.disruptions
        if failure.disrupted:  # as JobSet's RestartJobSetAndIgnoreMaxRestarts
            return finish("Restarting", "Disrupted",
                          f"{failure.describe()}; a disruption, not counted against runPolicy.maxRestarts "
                          f"({spent} of {max_restarts} spent): restart {c.restarts + 1}, resuming from the newest "
                          "checkpoint", support=True, delete=list(c.live), restart=True, disrupted=True)
        if spent >= max_restarts:
            return finish("Failed", "RestartLimitExceeded",
                          f"{failure.describe()}; no restarts left (runPolicy.maxRestarts={max_restarts})",
                          delete=stop)
        return finish("Restarting", "PodFailed",
                      f"{failure.describe()}; restart {spent + 1} of {max_restarts}, resuming from the "
                      "newest checkpoint", support=True, delete=list(c.live), restart=True)
    if _deadline_passed(job, c.meta, c.conds, now):
        return finish("Failed", "DeadlineExceeded",
                      f"ran longer than runPolicy.activeDeadlineSeconds ({job.spec.run_policy.active_deadline_seconds} s)",
                      delete=list(c.live))
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
    return _pods_phase(job, c.ours, c.restarts, all(k in c.current for k in required), finish)


def _deadline_passed(job: RLHFJob, meta: dict[str, Any], conds: dict[str, dict[str, Any]], now: datetime) -> bool:
    deadline = job.spec.run_policy.active_deadline_seconds
    if deadline is None:
        return False
    resumed = conds.get("Suspended")
    start = parse_time(meta.get("creationTimestamp")) or now
    if resumed and resumed.get("status") == "False":
        start = max(start, parse_time(resumed.get("lastTransitionTime")) or start)
    return now >= start + timedelta(seconds=deadline)


def _pods_phase(job: RLHFJob, ours: list[dict[str, Any]], attempt: int, workloads_exist: bool, finish) -> Plan:
    """Pending, Initializing or Running, from the pods of `attempt` (both backends)."""
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


def _plan_jobset(job: RLHFJob, meta: dict[str, Any], observed: Observed, ours: list[dict[str, Any]],
                 current: dict[str, dict[str, Any]], restarts: int, conds: dict[str, dict[str, Any]], now: datetime,
                 finish) -> Plan:
    """Backend JobSet: JobSet restarts its jobs (failure policy) and ends in Completed or
    Failed; the job's phase, restarts and messages are read from it and its pods."""
    js = current.get("JobSet")
    if job.spec.suspend:  # JobSet's own suspend: its jobs' pods go, the JobSet and its restart count stay
        return finish("Suspended", "Suspended", "spec.suspend is true: pods deleted, checkpoints kept",
                      support=True, create=True)
    if _deadline_passed(job, meta, conds, now):
        return finish("Failed", "DeadlineExceeded",
                      f"ran longer than runPolicy.activeDeadlineSeconds ({job.spec.run_policy.active_deadline_seconds} s)",
                      delete=["JobSet"] if js else [])
    if js is None:
        other = observed.jobset
        if other is not None:  # of an earlier job of the same name, or being deleted
            return finish("Pending", "WaitingForOldPods", "waiting for the JobSet of an earlier run to be deleted",
                          support=True, delete=[] if other["metadata"].get("deletionTimestamp") else ["JobSet"])
        return finish("Pending", "CreatingPods", "creating the JobSet", support=True, create=True)

    st = js.get("status") or {}
    js_restarts = int(st.get("restarts") or 0)
    counted = int(st.get("restartsCountTowardsMax", js_restarts) or 0)  # RestartJobSetAndIgnoreMaxRestarts: not
    max_restarts = js["spec"].get("failurePolicy", {}).get("maxRestarts", 0)

    def failure_of(attempts: range) -> Failure | None:
        return attempt_failure([p for p in ours if attempt_of(p) in attempts])

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
    if js_restarts > restarts:
        failure = failure_of(range(restarts, js_restarts))
        what = failure.describe() if failure else "a pod failed"
        if failure is not None and failure.disrupted:
            return finish("Restarting", "Disrupted", f"{what}; a disruption, not counted against "
                          f"runPolicy.maxRestarts ({counted} of {max_restarts} spent): restart {js_restarts} by the "
                          "JobSet's failure policy, resuming from the newest checkpoint", support=True, create=True,
                          restarts_now=js_restarts, disruptions_now=js_restarts - counted)
        return finish("Restarting", "PodFailed",
                      f"{what}; restart {counted} of {max_restarts} by the JobSet's failure policy, resuming "
                      "from the newest checkpoint", support=True, create=True, restarts_now=js_restarts,
                      disruptions_now=js_restarts - counted)
    restarting = conds.get("Restarting", {})
    if restarts > js_restarts:  # announced below; the JobSet has not recreated its jobs yet
        return finish("Restarting", restarting.get("reason", "PodFailed"), restarting.get("message", ""),
                      support=True, create=True)
    # A pod of the current attempt failed and the JobSet has not acted yet: its failure
    # policy (which we wrote) decides exactly as below, so the status says so at once
    # instead of after the Job and JobSet controllers have caught up (seconds under load).
    failure = failure_of(range(restarts, restarts + 1))
    if failure is not None and failure.final:  # a pod still being evicted: its Job decides once it has failed
        if failure.permanent:
            return finish("Failed", "PermanentError", failure.describe())
        if failure.disrupted:
            return finish("Restarting", "Disrupted", f"{failure.describe()}; a disruption, not counted against "
                          f"runPolicy.maxRestarts ({counted} of {max_restarts} spent): restart {restarts + 1} by the "
                          "JobSet's failure policy, resuming from the newest checkpoint", support=True, create=True,
                          restart=True, disrupted=True)
        if counted >= max_restarts:
            return finish("Failed", "RestartLimitExceeded",
                          f"{failure.describe()}; no restarts left (runPolicy.maxRestarts={max_restarts})")
        return finish("Restarting", "PodFailed",
                      f"{failure.describe()}; restart {counted + 1} of {max_restarts} by the JobSet's failure "
                      "policy, resuming from the newest checkpoint", support=True, create=True, restart=True)
    if js["spec"].get("suspend"):
        return finish("Pending", "JobSetSuspended",
                      "the JobSet is suspended (waiting for admission, e.g. by Kueue)", support=True, create=True)
    return _pods_phase(job, ours, restarts, True, finish)

