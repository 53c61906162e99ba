"""The job's status conditions, each set by its own small function from the phase just
decided: Suspended, Running, Restarting, Succeeded, Failed; and two set after an apply:
`ChildRefused` (`refused_condition`): True with the API server's message while it refuses a
child of the job (a 422: e.g. an invalid `spec.pod.volumes` entry), False once it accepts
them; `ChildConflict` (`conflict_condition`): True, naming the objects, while objects with
the names of the job's children exist that the job does not control (ownership.py), False
once they are gone; `BackendMissing` (`missing_condition`): True, naming the CRD and what
installs it, while the cluster has no CRD of the job's backend (its workload's create is a
404), False once it has. A condition's transition time moves only when its status does."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .failures import ts

CHILD_REFUSED = "ChildRefused"
CHILD_CONFLICT = "ChildConflict"
BACKEND_MISSING = "BackendMissing"
CONDITION_TYPES = ("Suspended", "Running", "Restarting", "Succeeded", "Failed", CHILD_REFUSED, CHILD_CONFLICT,
                   BACKEND_MISSING)


def conditions_by_type(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def _set(conds: dict[str, dict[str, Any]], type_: str, value: bool | None, reason: str, message: str,
         now: datetime, generation: int | None = None) -> None:
    """Set (or, with value None, leave absent) one condition; the transition time moves
    only when the status does. As the API conventions ask: a reason always (CamelCase),
    the generation it was set from."""
    if value is None:
        if type_ in conds and generation is not None:
            conds[type_] = {**conds[type_], "observedGeneration": generation}
        return
    status = "True" if value else "False"
    old = conds.get(type_)
    when = (old.get("lastTransitionTime") if old and old.get("status") == status else None) or ts(now)
    conds[type_] = {"type": type_, "status": status, "reason": reason or type_, "message": message,
                    "lastTransitionTime": when,
                    **({"observedGeneration": generation} if generation is not None else {})}


def set_conditions(conds: dict[str, dict[str, Any]], phase: str, reason: str, message: str, now: datetime,
                   generation: int | None = None) -> None:
    for type_, decide in (("Suspended", suspended_condition), ("Running", running_condition),
                          ("Restarting", restarting_condition), ("Succeeded", succeeded_condition),
                          ("Failed", failed_condition)):
        _set(conds, type_, *decide(conds, phase, reason, message), now, generation)


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


def _outcome_condition(conds: dict[str, dict[str, Any]], type_: str, problem: str | None, reason: str,
                       cleared: tuple[str, str], now: datetime, generation: int | None) -> bool:
    """Set `type_` True with `problem`, or False with `cleared` (reason, message) once a
    problem it showed is gone (absent while there never was one); True when it changed."""
    old = dict(conds.get(type_) or {})
    if problem is not None:
        _set(conds, type_, True, reason, problem, now, generation)
    elif old.get("status") == "True":
        _set(conds, type_, False, *cleared, now, generation)
    return conds.get(type_) != (old or None)


def refused_condition(conds: dict[str, dict[str, Any]], refusal: str | None, now: datetime,
                      generation: int | None = None) -> bool:
    """Set `ChildRefused` from an apply's outcome (`refusal`: the server's message, or None
    when every child was accepted); True when the condition changed."""
    return _outcome_condition(conds, CHILD_REFUSED, refusal, "Invalid",
                              ("Accepted", "the API server accepts every child of the job"), now, generation)


def conflict_condition(conds: dict[str, dict[str, Any]], conflict: str | None, now: datetime,
                       generation: int | None = None) -> bool:
    """Set `ChildConflict` from an apply's outcome (`conflict`: the objects in the way, or
    None when every child is the job's or absent); True when the condition changed."""
    return _outcome_condition(conds, CHILD_CONFLICT, conflict, "NotOwned",
                              ("Resolved", "every child of the job is the job's own"), now, generation)


def missing_condition(conds: dict[str, dict[str, Any]], missing: str | None, now: datetime,
                      generation: int | None = None) -> bool:
    """Set `BackendMissing` from an apply's outcome (`missing`: which CRD and what to install,
    or None once the workload was written); True when the condition changed."""
    return _outcome_condition(conds, BACKEND_MISSING, missing, "CRDNotFound",
                              ("Installed", "the cluster has the backend's CRD"), now, generation)
