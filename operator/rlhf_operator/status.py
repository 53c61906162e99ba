"""PURE status computation: (job, observed children, now) -> the job's new status and what
to do about the children. No API calls; handlers.py carries the plan out.

One restart domain. The attempt number is `status.restarts`; the children of attempt N
carry `rlhf.dev/attempt: N`. When a pod of the current attempt fails:
- its exit code is permanent (`PERMANENT_EXIT_CODES`) -> Failed at once;
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
set by its own function: Suspended, Running, Restarting, Succeeded, Failed.

Simplifications: a rollout pod that the StatefulSet replaced while the operator was down
is noticed only through its containers' restart counts; `activeDeadlineSeconds` counts
from the job's creation or its last resume (the status has no startTime field).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from rlhf_contract.api.models import RLHFJob
from .builders.meta import LABEL_JOB_UID, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, attempt_of

# Exit codes of our entry points that no restart can fix (the one list of them).
PERMANENT_EXIT_CODES: dict[int, str] = {
    2: "invalid job config or command-line usage",
    126: "command not executable (broken image)",
    127: "command not found (broken image)",
}

TERMINAL = ("Succeeded", "Failed")
TERMINAL_GRACE = timedelta(seconds=60)
# A pod on a node that has not been Ready for this long is lost (see the module docstring).
NODE_LOST_AFTER = timedelta(seconds=60)
# The training-operator deletes a failed trainer pod at once; its exit code reaches us
# through the pod's watch events. A PyTorchJob marked Failed with no failed pod in sight
# is therefore given this long for that evidence before it counts as a retryable failure.
EVIDENCE_GRACE = timedelta(seconds=10)
CONDITION_TYPES = ("Suspended", "Running", "Restarting", "Succeeded", "Failed")


@dataclass
class Observed:
    """What exists of the job's children (as the API returned them)."""

    statefulset: dict[str, Any] | None = None
    pytorchjob: dict[str, Any] | None = None
    jobset: dict[str, Any] | None = None
    """Backend JobSet: the job's JobSet (then statefulset and pytorchjob are None)."""
    pods: list[dict[str, Any]] = field(default_factory=list)
    nodes_not_ready: dict[str, datetime] = field(default_factory=dict)
    """Nodes of the job's pods that are not Ready: name -> since when (the Ready
    condition's lastTransitionTime)."""


@dataclass(frozen=True)
class Failure:
    pod: str
    role: str
    container: str | None
    exit_code: int | None
    reason: str
    message: str = ""

    @property
    def permanent(self) -> bool:
        return self.exit_code in PERMANENT_EXIT_CODES

    def describe(self) -> str:
        what = f"{self.role} pod {self.pod}"
        if self.container:
            what += f" container {self.container}"
        if self.exit_code is not None:
            what += f" exited with code {self.exit_code}"
            if self.exit_code in PERMANENT_EXIT_CODES:
                what += f" ({PERMANENT_EXIT_CODES[self.exit_code]})"
        else:
            what += " failed"
        if self.reason:
            what += f" [{self.reason}]"
        if self.message:
            what += f": {' '.join(self.message.split())[-300:]}"
        return what


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


# ---------------------------------------------------------------- helpers


def _ts(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


def _owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(r.get("uid") == uid and r.get("controller") for r in obj.get("metadata", {}).get("ownerReferences") or [])




def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def _set(conds: dict[str, dict[str, Any]], type_: str, value: bool | None, reason: str, message: str,
         now: datetime) -> None:
    """Set (or, with value None, leave absent) one condition; the transition time moves
    only when the status does."""
    if value is None:
        return
    status = "True" if value else "False"
    old = conds.get(type_)
    when = old.get("lastTransitionTime") if old and old.get("status") == status else _ts(now)
    conds[type_] = {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": when}


def pod_failure(pod: dict[str, Any]) -> Failure | None:
    """The first sign that a pod failed: a container that terminated (any exit code for a
    rollout server, which must never exit; non-zero for a trainer), a container restart,
    or a Failed phase (evictions)."""
    role = _labels(pod).get(LABEL_ROLE, "?")
    name = pod["metadata"]["name"]
    st = pod.get("status") or {}
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            if term and (term.get("exitCode", 0) != 0 or role == ROLE_ROLLOUT):
                return Failure(name, role, cs.get("name"), term.get("exitCode"), term.get("reason") or "",
                               term.get("message") or "")
        if role == ROLE_ROLLOUT and cs.get("restartCount", 0) > 0:
            return Failure(name, role, cs.get("name"), None, "ContainerRestarted")
    if st.get("phase") == "Failed":
        return Failure(name, role, None, None, st.get("reason") or "PodFailed", st.get("message") or "")
    if st.get("phase") == "Succeeded" and role == ROLE_ROLLOUT:
        return Failure(name, role, None, 0, "RolloutServerExited")
    return None


def lost_pod(pod: dict[str, Any], nodes_not_ready: dict[str, datetime], now: datetime,
             after: timedelta = NODE_LOST_AFTER) -> Failure | None:
    """The pod's node has not been Ready for `after`: the pod is lost with it."""
    node = (pod.get("spec") or {}).get("nodeName")
    since = nodes_not_ready.get(node) if node else None
    if since is None or now < since + after:
        return None
    return Failure(pod["metadata"]["name"], _labels(pod).get(LABEL_ROLE, "?"), None, None, "NodeLost",
                   f"node {node} not Ready since {_ts(since)}")


def attempt_failure(pods: list[dict[str, Any]],
                    lost: Callable[[dict[str, Any]], Failure | None] = lambda pod: None) -> Failure | None:
    """The first failure (by pod name) among the pods of one attempt: `pod_failure`, or
    `lost` (the pod's node is gone). A server's does not count once a trainer pod has
    succeeded (Succeeded dominates)."""
    trainer_done = any(_labels(p).get(LABEL_ROLE) == ROLE_TRAINER
                       and (p.get("status") or {}).get("phase") == "Succeeded" for p in pods)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        failure = pod_failure(pod) or lost(pod)
        if failure and not (trainer_done and failure.role == ROLE_ROLLOUT):
            return failure
    return None


def _ptj_condition(ptj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in (ptj or {}).get("status", {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


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


def _plan(body: dict[str, Any], job: RLHFJob | None, observed: Observed, now: datetime, invalid: str | None,
          node_lost_after: timedelta) -> Plan:
    meta = body.get("metadata", {})
    uid = meta.get("uid", "")
    old = copy.deepcopy(body.get("status") or {})
    restarts = int(old.get("restarts") or 0)
    conds = _conditions(old)
    prev_phase = old.get("phase")
    progress = dict(old.get("progress") or {})
    if job is not None and not progress.get("totalSteps"):
        progress["totalSteps"] = job.spec.schedule.total_steps

    ours = [p for p in observed.pods if _labels(p).get(LABEL_JOB_UID) == uid]
    workloads = {"StatefulSet": observed.statefulset, "PyTorchJob": observed.pytorchjob, "JobSet": observed.jobset}
    # A JobSet lives through every attempt (it restarts its own jobs).
    current = {k: w for k, w in workloads.items() if w is not None and _owned_by(w, uid)
               and (k == "JobSet" or attempt_of(w) == restarts) and not w["metadata"].get("deletionTimestamp")}
    stale = [k for k, w in workloads.items() if w is not None and k not in current
             and not w["metadata"].get("deletionTimestamp")]

    def finish(phase: str, reason: str, message: str, *, create: bool = False, support: bool = False,
               delete: list[str] | None = None, delete_job: bool = False, restart: bool = False,
               restarts_now: int | None = None) -> Plan:
        set_conditions(conds, phase, reason, message, now)
        status = {
            "phase": phase,
            "conditions": [conds[t] for t in CONDITION_TYPES if t in conds],
            "observedGeneration": meta.get("generation"),
            "restarts": restarts_now if restarts_now is not None else restarts + (1 if restart else 0),
            "progress": progress,
        }
        events = []
        if phase != prev_phase or restart:
            warn = phase in ("Failed", "Restarting")
            events.append(Event("Warning" if warn else "Normal", reason if warn else phase, message))
        return Plan(status, apply_support=support, create_workloads=create, delete=delete or [],
                    delete_job=delete_job, events=events)

    live = {k: w for k, w in workloads.items() if w is not None and not w["metadata"].get("deletionTimestamp")}

    # Terminal: nothing is created again. The rollout servers go at once; an unfinished
    # PyTorchJob after a grace period (a finished one keeps its failed pods for their logs).
    if prev_phase in TERMINAL:
        cond = conds.get(prev_phase, {})
        finished = parse_time(cond.get("lastTransitionTime")) or now
        ptj_done = (_ptj_condition(observed.pytorchjob, "Succeeded") or _ptj_condition(observed.pytorchjob, "Failed")
                    or _ptj_condition(observed.jobset, "Completed") or _ptj_condition(observed.jobset, "Failed"))
        delete = [k for k in live if k == "StatefulSet" or (not ptj_done and now >= finished + TERMINAL_GRACE)]
        ttl = job.spec.run_policy.ttl_seconds_after_finished if job else None
        expired = ttl is not None and now >= finished + timedelta(seconds=ttl)
        return finish(prev_phase, cond.get("reason", prev_phase), cond.get("message", ""), delete=delete,
                      delete_job=expired)

    if job is None:
        return finish("Failed", "InvalidSpec", invalid or "the job does not validate", delete=list(live))

    if job.spec.backend == "JobSet":
        return _plan_jobset(job, meta, observed, ours, current, restarts, conds, now, finish)

    if job.spec.suspend:
        return finish("Suspended", "Suspended", "spec.suspend is true: pods deleted, checkpoints kept",
                      support=True, delete=list(live))

    # Succeeded dominates: a finished trainer is never restarted, whatever the servers do.
    if _ptj_condition(current.get("PyTorchJob"), "Succeeded"):
        return finish("Succeeded", "TrainerSucceeded", "the trainer finished every step",
                      delete=[k for k in live if k == "StatefulSet"])
    # Failures of the current attempt (a server's, once the trainer is done, do not count).
    failure = attempt_failure([p for p in ours if attempt_of(p) == restarts],
                              lambda pod: lost_pod(pod, observed.nodes_not_ready, now, node_lost_after))
    ptj_failed = _ptj_condition(current.get("PyTorchJob"), "Failed")
    if ptj_failed and now < (parse_time(ptj_failed.get("lastTransitionTime")) or now) + EVIDENCE_GRACE:
        ptj_failed = None  # wait a moment for the failed pod's exit code
    if failure is None and ptj_failed:
        failure = Failure(current["PyTorchJob"]["metadata"]["name"], ROLE_TRAINER, None, None,
                          ptj_failed.get("reason") or "PyTorchJobFailed", ptj_failed.get("message") or "")
    if failure is not None:
        # Keep a failed trainer's PyTorchJob (its pods' logs); stop everything else.
        stop = [k for k in live if not (k == "PyTorchJob" and failure.role == ROLE_TRAINER)]
        if failure.permanent:
            return finish("Failed", "PermanentError", failure.describe(), delete=stop)
        max_restarts = job.spec.run_policy.max_restarts
        if restarts >= max_restarts:
            return finish("Failed", "RestartLimitExceeded",
                          f"{failure.describe()}; no restarts left (runPolicy.maxRestarts={max_restarts})",
                          delete=stop)
        return finish("Restarting", "PodFailed",
                      f"{failure.describe()}; restart {restarts + 1} of {max_restarts}, resuming from the "
                      "newest checkpoint", support=True, delete=list(live), restart=True)

    if _deadline_passed(job, meta, conds, now):
        return finish("Failed", "DeadlineExceeded",
                      f"ran longer than runPolicy.activeDeadlineSeconds ({job.spec.run_policy.active_deadline_seconds} s)",
                      delete=list(live))

    # Workloads of an earlier attempt (or of an earlier job of the same name) still exist,
    # or their pods do: delete, and create the new attempt only once no pod is left.
    leftovers = [p for p in observed.pods if p not in ours or attempt_of(p) != restarts]
    if stale or (not current and leftovers):
        restarting = conds.get("Restarting", {})
        if restarting.get("status") == "True":
            return finish("Restarting", restarting.get("reason", "PodFailed"), restarting.get("message", ""),
                          support=True, delete=stale)
        return finish("Pending", "WaitingForOldPods",
                      f"waiting for {len(leftovers)} pod(s) of an earlier run to be deleted", support=True,
                      delete=stale)

    required = ["PyTorchJob"] if job.spec.offline else ["StatefulSet", "PyTorchJob"]
    return _pods_phase(job, ours, restarts, all(k in current for k in required), finish)


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
    if job.spec.offline:  # sft, rm, dpo run the trainer alone
        expected = {ROLE_TRAINER: job.spec.trainer.num_nodes}
    else:
        expected = {ROLE_ROLLOUT: job.spec.rollout.replicas, ROLE_TRAINER: job.spec.trainer.num_nodes}
    pods = [p for p in ours if attempt_of(p) == attempt and not p["metadata"].get("deletionTimestamp")]
    by_role = {r: [p for p in pods if _labels(p).get(LABEL_ROLE) == r] for r in expected}
    counts = ", ".join(f"{sum((p.get('status') or {}).get('phase') == 'Running' for p in by_role[r])}/{n} {r}"
                       for r, n in expected.items())
    if not workloads_exist or any(len(by_role[r]) < n for r, n in expected.items()):
        return finish("Pending", "CreatingPods", f"waiting for pods: {counts} running", support=True, create=True)
    if not all(p.get("spec", {}).get("nodeName") for p in pods):
        return finish("Pending", "Unschedulable" if _unschedulable(pods) else "Scheduling",
                      f"waiting for pods to be scheduled: {counts} running", support=True, create=True)
    running = all((p.get("status") or {}).get("phase") == "Running" for p in pods)
    ready = all(_ready(p) for p in by_role.get(ROLE_ROLLOUT, []))
    if running and ready:
        return finish("Running", "AllPodsRunning",
                      f"{counts} running" + ("" if job.spec.offline else "; rollout servers ready"), support=True,
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
    max_restarts = js["spec"].get("failurePolicy", {}).get("maxRestarts", 0)

    def failure_of(attempts: range) -> Failure | None:
        return attempt_failure([p for p in ours if attempt_of(p) in attempts])

    if _ptj_condition(js, "Completed"):
        return finish("Succeeded", "TrainerSucceeded", "the trainer finished every step", restarts_now=js_restarts)
    if failed := _ptj_condition(js, "Failed"):
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
        return finish("Restarting", "PodFailed",
                      f"{what}; restart {js_restarts} of {max_restarts} by the JobSet's failure policy, resuming "
                      "from the newest checkpoint", support=True, create=True, restarts_now=js_restarts)
    restarting = conds.get("Restarting", {})
    if restarts > js_restarts:  # announced below; the JobSet has not recreated its jobs yet
        return finish("Restarting", restarting.get("reason", "PodFailed"), restarting.get("message", ""),
                      support=True, create=True)
    # A pod of the current attempt failed and the JobSet has not acted yet: its failure
    # policy (which we wrote) decides exactly as below, so the status says so at once
    # instead of after the Job and JobSet controllers have caught up (seconds under load).
    if (failure := failure_of(range(restarts, restarts + 1))) is not None:
        if failure.permanent:
            return finish("Failed", "PermanentError", failure.describe())
        if restarts >= max_restarts:
            return finish("Failed", "RestartLimitExceeded",
                          f"{failure.describe()}; no restarts left (runPolicy.maxRestarts={max_restarts})")
        return finish("Restarting", "PodFailed",
                      f"{failure.describe()}; restart {restarts + 1} of {max_restarts} by the JobSet's failure "
                      "policy, resuming from the newest checkpoint", support=True, create=True, restart=True)
    if js["spec"].get("suspend"):
        return finish("Pending", "JobSetSuspended",
                      "the JobSet is suspended (waiting for admission, e.g. by Kueue)", support=True, create=True)
    return _pods_phase(job, ours, restarts, True, finish)


def _unschedulable(pods: list[dict[str, Any]]) -> bool:
    return any(c.get("reason") == "Unschedulable" for p in pods for c in (p.get("status") or {}).get("conditions") or [])


# ---------------------------------------------------------------- conditions, one function each


def set_conditions(conds: dict[str, dict[str, Any]], phase: str, reason: str, message: str, now: datetime) -> None:
    _set(conds, "Suspended", *suspended_condition(conds, phase, reason, message), now)
    _set(conds, "Running", *running_condition(conds, phase, reason, message), now)
    _set(conds, "Restarting", *restarting_condition(conds, phase, reason, message), now)
    _set(conds, "Succeeded", *succeeded_condition(conds, phase, reason, message), now)
    _set(conds, "Failed", *failed_condition(conds, phase, reason, message), now)


def suspended_condition(conds, phase, reason, message) -> tuple[bool | None, str, str]:
    if phase == "Suspended":
        return True, reason, message
    if "Suspended" in conds and conds["Suspended"]["status"] == "True":
        return False, "Resumed", "spec.suspend is false: the job runs again from its newest checkpoint"
    return None, "", ""  # unchanged (or absent)


def running_condition(conds, phase, reason, message) -> tuple[bool | None, str, str]:
    if phase == "Running":
        return True, reason, message
    if "Running" in conds:
        return False, reason, message
    return None, "", ""


def restarting_condition(conds, phase, reason, message) -> tuple[bool | None, str, str]:
    if phase == "Restarting":
        return True, reason, message
    if conds.get("Restarting", {}).get("status") == "True":
        return False, "Restarted", f"new pods created after: {conds['Restarting'].get('message', '')}"
    return None, "", ""


def succeeded_condition(conds, phase, reason, message) -> tuple[bool | None, str, str]:
    return (True, reason, message) if phase == "Succeeded" else (None, "", "")


def failed_condition(conds, phase, reason, message) -> tuple[bool | None, str, str]:
    return (True, reason, message) if phase == "Failed" else (None, "", "")
