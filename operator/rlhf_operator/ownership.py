"""PURE: whose a child is. A job's own children carry an ownerReference to it with
`controller: true` and its uid (builders/meta.py `owner_reference`). An object that has a
child's name but not that reference is someone else's, and the operator never writes or
deletes it (reconcile.py reads before it first writes, and writes and deletes by uid
afterwards); the job waits with a `ChildConflict` condition naming the object
(conditions.py) until the object is gone or the job is renamed.

One exception is not a conflict: an object controlled by an earlier RLHFJob of the same
name (deleted and created again). The garbage collector is removing it; the job waits
for that without a condition.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import KIND


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The ownerReference with `controller: true` (Kubernetes allows at most one)."""
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    ref = controller_of(obj)
    return bool(uid) and ref is not None and ref.get("uid") == uid


def earlier_job(obj: dict[str, Any], job_name: str) -> bool:
    """Controlled by an RLHFJob of `job_name` (then, as the caller checked, not this one:
    an earlier job of the name, whose children the garbage collector removes)."""
    ref = controller_of(obj)
    return ref is not None and ref.get("kind") == KIND and ref.get("name") == job_name


def conflict(obj: dict[str, Any], job_name: str) -> str:
    """The message of a same-named object the job does not control: what it is, whose, and
    what the user can do."""
    meta, ref = obj.get("metadata") or {}, controller_of(obj)
    whose = f"controlled by {ref.get('kind')} {ref.get('name')}" if ref else "controlled by no object"
    return (f"{obj.get('kind')} {meta.get('name')} already exists and is not this job's ({whose}); the operator "
            f"leaves it untouched: delete it, or create the job under another name than {job_name!r}")
