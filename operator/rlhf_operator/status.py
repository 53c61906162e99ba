"""PURE status computation: (job, observed children, now) -> the job's new status and what
to do about the children. No API calls; reconcile.py carries the plan out. What differs by
backend (its workloads, who restarts, what its workload's state says) is the backend's
`plan` (backends/); this module holds what every job shares: the status itself, terminal
phases, an invalid spec, lost nodes.

One restart domain (backends PyTorchJob and TrainJob; JobSet's own failure policy decides
the same way, backends/jobset.py). The attempt number is `status.restarts`; the children of attempt N
carry `rlhf.dev/attempt: N`. When a pod of the current attempt fails:
- its exit code is permanent (`rlhf_contract.exit_codes.PERMANENT`) -> Failed at once;
- restarts < runPolicy.maxRestarts -> restarts + 1, phase Restarting: the workloads of
  attempt N are deleted, and those of N + 1 are created only once no pod of the job is
  left (`Plan.create_workloads`);
- otherwise -> Failed, naming the pod and its exit code.
The decision is written to the status before anything is deleted, so an operator killed
at any point resumes the same restart. Succeeded and Failed are terminal: nothing is
created again, whatever happens to the children. Succeeded dominates: once the trainer
has finished (its trainer workload Succeeded), a rollout server dying is no reason to restart.
The restart decision itself, for every backend: `backends.base.decide_failure`.

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
from datetime import datetime, timedelta
from typing import Any, Callable

from rlhf_contract.api.models import Condition, Progress, RLHFJob, RLHFJobStatus
from rlhf_contract.redact import redact_text

from .backends import BACKENDS, of_job, workloads_of
from .backends.base import Context, Event, Observed, Plan
from .lws_status import ROLLOUT_KINDS
from .builders.meta import LABEL_JOB_UID, attempt_of
from .conditions import CONDITION_TYPES, conditions_by_type, set_conditions
from .failures import NODE_LOST_AFTER, Failure, attempt_failure, labels, lost_pod, parse_time, pod_failure, ts
from .ownership import controlled_by

__all__ = ["NODE_LOST_AFTER", "Event", "Failure", "Observed", "Plan", "as_stored", "attempt_failure",
           "lost_pod", "parse_time", "plan", "pod_failure", "set_conditions", "status_view"]

TERMINAL = ("Succeeded", "Failed")
TERMINAL_GRACE = timedelta(seconds=60)


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


def _context(body: dict[str, Any], job: RLHFJob | None, observed: Observed) -> Context:
    meta = body.get("metadata", {})
    uid = meta.get("uid", "")
    old = copy.deepcopy(body.get("status") or {})
    restarts = int(old.get("restarts") or 0)
    progress = dict(old.get("progress") or {})
    if job is not None and not progress.get("totalSteps"):
        progress["totalSteps"] = job.spec.schedule.total_steps
    workloads = workloads_of(observed)
    # A workload of a backend that restarts its own jobs lives through every attempt.
    lasting = {b.name for b in BACKENDS.values() if b.restarts_itself}
    current = {k: w for k, w in workloads.items() if w is not None and controlled_by(w, uid)
               and (k in lasting or attempt_of(w) == restarts) and not w["metadata"].get("deletionTimestamp")}
    stale = [k for k, w in workloads.items() if w is not None and k not in current
             and not w["metadata"].get("deletionTimestamp")]
    live = {k: w for k, w in workloads.items() if w is not None and not w["metadata"].get("deletionTimestamp")}
    return Context(meta, restarts, conditions_by_type(old), old.get("phase"), progress,
                   [p for p in observed.pods if labels(p).get(LABEL_JOB_UID) == uid], current, stale, live, old)


def _finisher(c: Context, now: datetime) -> Callable[..., Plan]:
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
    return of_job(job).plan(job, observed, c, now, node_lost_after, finish)


def _terminal(job: RLHFJob | None, observed: Observed, c: Context, now: datetime, finish) -> Plan:
    """Terminal: nothing is created again. The rollout servers go at once; an unfinished
    trainer workload after a grace period (a finished one keeps its failed pods for their logs)."""
    cond = c.conds.get(c.prev_phase, {})
    finished = parse_time(cond.get("lastTransitionTime")) or now
    done = any(b.ended(observed) for b in BACKENDS.values())
    delete = [k for k in c.live if k in ROLLOUT_KINDS or (not done and now >= finished + TERMINAL_GRACE)]
    ttl = job.spec.run_policy.ttl_seconds_after_finished if job else None
    expired = ttl is not None and now >= finished + timedelta(seconds=ttl)
    return finish(c.prev_phase, cond.get("reason", c.prev_phase), cond.get("message", ""), delete=delete,
                  delete_job=expired)


# ---------------------------------------------------------------- what is written and compared

def status_view(st: dict[str, Any]) -> dict[str, Any]:
    """The part of the status the operator owns (the trainer owns progress, but totalSteps),
    what is compared and written: its messages with URL credentials cut (`redact_text`)."""
    view = {k: v for k, v in st.items() if k != "progress"}
    if isinstance(view.get("message"), str):
        view["message"] = redact_text(view["message"])
    if view.get("conditions"):
        view["conditions"] = [{**c, "message": redact_text(c["message"])} if isinstance(c.get("message"), str) else c
                              for c in view["conditions"]]
    view["progress"] = {"totalSteps": (st.get("progress") or {}).get("totalSteps")}
    return view


def _defaults(model: type) -> dict[str, Any]:
    return {(f.alias or n): f.default for n, f in model.model_fields.items() if not f.is_required()}


_STATUS_DEFAULTS = {k: v for k, v in _defaults(RLHFJobStatus).items() if k not in ("progress", "conditions", "phase")}
_CONDITION_DEFAULTS = _defaults(Condition)
_PROGRESS_DEFAULTS = _defaults(Progress)


def _stored(obj: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A merge patch's object as stored: a null removes the key, then the default fills it."""
    return {**defaults, **{k: v for k, v in obj.items() if v is not None}}


def as_stored(view: dict[str, Any]) -> dict[str, Any]:
    """A `status_view` as the API server returns it once written: the CRD's defaults (the
    contract's status model: `disruptions: 0`, `completionTime: null`, `progress.totalSteps:
    0`, ...) filled in. The status read back always carries them and a plan's leaves them
    out, so compared as they were, a steady job's status differed on every reconcile and
    was patched each time (the most expensive request of a reconcile)."""
    out = _stored(view, _STATUS_DEFAULTS)
    if isinstance(out.get("conditions"), list):
        out["conditions"] = [_stored(c, _CONDITION_DEFAULTS) if isinstance(c, dict) else c for c in out["conditions"]]
    if isinstance(out.get("progress"), dict):
        out["progress"] = {k: v for k, v in _stored(out["progress"], _PROGRESS_DEFAULTS).items() if k == "totalSteps"}
    return out
