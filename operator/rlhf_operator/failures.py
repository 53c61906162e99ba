"""What the pods and workloads of a job say, read without side effects: a pod's failure
(`pod_failure`; `disrupted` when Kubernetes took the pod away: its `DisruptionTarget`
condition (preemption, eviction by a node drain, taint manager, kubelet shutdown), or our
trainer's exit code 143 after a SIGTERM), a pod lost with its node (`lost_pod`, a
disruption too), the first failure of an attempt
(`attempt_failure`), a workload's True condition, a pod's readiness. Which exit codes no
restart can fix, and what each means, is `rlhf_contract.exit_codes`' table."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from rlhf_contract.exit_codes import ExitCode, is_permanent, meaning

from .builders.meta import LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER

# A pod on a node that has not been Ready for this long is lost (see the module docstring).
NODE_LOST_AFTER = timedelta(seconds=60)

@dataclass(frozen=True)
class Failure:
    pod: str
    role: str
    container: str | None
    exit_code: int | None
    reason: str
    message: str = ""
    disrupted: bool = False
    """Kubernetes took the pod away (not the job's fault): a restart that spends no budget."""
    final: bool = True
    """False for a pod being taken away that has not failed yet (evicted, still terminating)."""

    @property
    def permanent(self) -> bool:
        return is_permanent(self.exit_code)

    def describe(self) -> str:
        what = f"{self.role} pod {self.pod}"
        if self.container:
            what += f" container {self.container}"
        if self.exit_code is not None:
            what += f" exited with code {self.exit_code}"
            if meaning(self.exit_code):
                what += f" ({meaning(self.exit_code)})"
        else:
            what += " failed"
        if self.reason:
            what += f" [{self.reason}]"
        if self.message:
            what += f": {' '.join(self.message.split())[-300:]}"
        return what


def ts(now: datetime) -> str:
    return now.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("labels") or {}


DISRUPTION_CONDITION = "DisruptionTarget"


def disruption_reason(pod: dict[str, Any]) -> str | None:
    """The reason of the pod's True `DisruptionTarget` condition (PreemptionByScheduler,
    EvictionByEvictionAPI, DeletionByTaintManager, TerminationByKubelet, ...), or None."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == DISRUPTION_CONDITION and c.get("status") == "True":
            return c.get("reason") or DISRUPTION_CONDITION
    return None


def _disruption_message(pod: dict[str, Any]) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == DISRUPTION_CONDITION:
            return c.get("message") or ""
    return ""


def pod_failure(pod: dict[str, Any]) -> Failure | None:
    """The first sign that a pod failed (`_failure_of`), marked `disrupted` when Kubernetes
    took the pod away or the trainer stopped on SIGTERM."""
    failure = _failure_of(pod)
    why = disruption_reason(pod)
    if failure is None and why is not None:  # being taken away (evicted, preempted): the attempt is over
        return Failure(pod["metadata"]["name"], labels(pod).get(LABEL_ROLE, "?"), None, None,
                       f"{DISRUPTION_CONDITION}: {why}", _disruption_message(pod), disrupted=True, final=False)
    if failure is None:
        return None
    if why is not None:
        return replace(failure, disrupted=True, reason=f"{failure.reason}, {DISRUPTION_CONDITION}: {why}".lstrip(", "))
    if failure.exit_code == ExitCode.TERMINATED and failure.role == ROLE_TRAINER:
        return replace(failure, disrupted=True)
    return failure


def _failure_of(pod: dict[str, Any]) -> Failure | None:
    """A container that terminated (any exit code for a rollout server, which must never
    exit; non-zero for a trainer or an init container), a container restart, or a Failed phase (evictions)."""
    role = labels(pod).get(LABEL_ROLE, "?")
    name = pod["metadata"]["name"]
    st = pod.get("status") or {}
    init = st.get("initContainerStatuses") or []
    for cs in init + (st.get("containerStatuses") or []):
        for key in ("state", "lastState"):
            term = (cs.get(key) or {}).get("terminated")
            # an init container (the download step) is meant to exit: only its failure counts
            if term and (term.get("exitCode", 0) != 0 or (role == ROLE_ROLLOUT and cs not in init)):
                return Failure(name, role, cs.get("name"), term.get("exitCode"), term.get("reason") or "",
                               term.get("message") or "")
        if role == ROLE_ROLLOUT and cs.get("restartCount", 0) > 0:
            return Failure(name, role, cs.get("name"), None, "ContainerRestarted")
    if st.get("phase") == "Failed":
        return Failure(name, role, None, None, st.get("reason") or "PodFailed", st.get("message") or "")
    if st.get("phase") == "Succeeded" and role == ROLE_ROLLOUT:
        return Failure(name, role, None, 0, "RolloutServerExited")
    return None


def left_to_kubelet(pod: dict[str, Any], replacements: int) -> bool:
    """A rollout server's container that terminated or restarted, with `rollout.maxServerReplacements`
    > 0: the StatefulSet's kubelet restarts it and the trainer re-joins it with the current weights
    (its own budget: exit 75 past it); a permanent exit code, an eviction or a lost node stays the job's."""
    if replacements <= 0 or labels(pod).get(LABEL_ROLE) != ROLE_ROLLOUT:
        return False
    failure = pod_failure(pod)
    return (failure is not None and not failure.permanent and not failure.disrupted
            and (pod.get("status") or {}).get("phase") not in ("Failed", "Succeeded"))


def lost_pod(pod: dict[str, Any], nodes_not_ready: dict[str, datetime], now: datetime,
             after: timedelta = NODE_LOST_AFTER) -> Failure | None:
    """The pod's node has not been Ready for `after`: the pod is lost with it."""
    node = (pod.get("spec") or {}).get("nodeName")
    since = nodes_not_ready.get(node) if node else None
    if since is None or now < since + after:
        return None
    return Failure(pod["metadata"]["name"], labels(pod).get(LABEL_ROLE, "?"), None, None, "NodeLost",
                   f"node {node} not Ready since {ts(since)}", disrupted=True)


def attempt_failure(pods: list[dict[str, Any]],
                    lost: Callable[[dict[str, Any]], Failure | None] = lambda pod: None) -> Failure | None:
    """The first failure (by pod name) among the pods of one attempt: `pod_failure`, or
    `lost` (the pod's node is gone). A server's does not count once a trainer pod has
    succeeded (Succeeded dominates)."""
    trainer_done = any(labels(p).get(LABEL_ROLE) == ROLE_TRAINER
                       and (p.get("status") or {}).get("phase") == "Succeeded" for p in pods)
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        failure = pod_failure(pod) or lost(pod)
        if failure and not (trainer_done and failure.role == ROLE_ROLLOUT):
            return failure
    return None


def true_condition(workload: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    """The workload's condition `type_` when it is True (PyTorchJob, JobSet)."""
    for c in (workload or {}).get("status", {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def unschedulable(pods: list[dict[str, Any]]) -> bool:
    return any(c.get("reason") == "Unschedulable" for p in pods for c in (p.get("status") or {}).get("conditions") or [])
