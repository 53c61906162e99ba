"""PURE reading of LeaderWorkerSet rollout servers (`rollout.nodesPerServer` > 1,
builders/lws.py) for status.py: a group of pods is one server.

- `servers`: the rollout pods as servers, one per complete group (every one of its
  `nodesPerServer` pods present), standing for its group: its leader, whose phase is
  Running only when every pod of the group runs. status.py counts and readies these as it
  counts a StatefulSet's pods.
- `left_to_lws`: a pod of an LWS group whose failure is the LWS controller's to repair
  (restartPolicy RecreateGroupOnPodRestart recreates the whole group), not a reason to restart
  the job; a permanent exit code still fails the job (a recreated group would fail the same
  way), and a lost node or an eviction restarts it as any pod's would. The trainer, whose requests to a recreated server fail, ends its attempt itself
  when it cannot go on.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract.api.models import RLHFJob

from .builders.meta import ROLE_ROLLOUT
from .builders.lws import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL, uses_lws
from .failures import labels, pod_failure

ROLLOUT_KINDS = ("StatefulSet", "LeaderWorkerSet")
"""The kinds a job's rollout servers are made of (status.py deletes either with them)."""


def rollout_kind(job: RLHFJob) -> str:
    return "LeaderWorkerSet" if uses_lws(job) else "StatefulSet"


def servers(job: RLHFJob, role: str, rollout_pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per rollout server (see the module docstring); the pods themselves for a
    StatefulSet's one-pod servers (and for any other role)."""
    if role != ROLE_ROLLOUT or not uses_lws(job):
        return rollout_pods
    groups: dict[str, list[dict[str, Any]]] = {}
    for pod in rollout_pods:
        groups.setdefault(labels(pod).get(LWS_GROUP_INDEX_LABEL, "?"), []).append(pod)
    out = []
    for _, pods in sorted(groups.items()):
        leader = next((p for p in pods if labels(p).get(LWS_WORKER_INDEX_LABEL) == "0"), None)
        if leader is None or len(pods) < job.spec.rollout.nodes_per_server:
            continue
        running = all((p.get("status") or {}).get("phase") == "Running" for p in pods)
        status = {**(leader.get("status") or {}), "phase": "Running" if running else "Pending"}
        out.append({**leader, "status": status})
    return out


def left_to_lws(pod: dict[str, Any]) -> bool:
    """The pod is in an LWS group and its container failed or restarted, not permanently and
    not by a disruption (a lost node or an eviction stays the job's, as for any pod)."""
    if LWS_NAME_LABEL not in labels(pod):
        return False
    failure = pod_failure(pod)
    return failure is not None and not failure.permanent and not failure.disrupted
