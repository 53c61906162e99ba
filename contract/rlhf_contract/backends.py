"""What each backend (`spec.backend`) needs installed on a cluster, named once: the CRD the
operator creates its workload through, and what installs it. The operator turns a missing
CRD into the job's `BackendMissing` condition; `rlhfctl env` lists what a cluster has and
`rlhfctl submit` refuses a job whose backend is missing. Kueue's presence is read from its
API group. Read through API discovery (what every authenticated user may read), not by
listing CRDs.

Not checked: that the CRD's controller runs (a CRD without its controller leaves the
workload unreconciled, which the job's phase shows), or its version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BackendNeeds:
    backend: str
    group: str
    version: str
    """The API version the operator writes the workload in."""
    plural: str
    install: str
    """What to install, as a user reads it."""

    @property
    def api_version(self) -> str:
        """`<group>/<version>`: the workload's apiVersion."""
        return f"{self.group}/{self.version}"

    @property
    def crd(self) -> str:
        """`<plural>.<group>`: the name of the workload's CustomResourceDefinition."""
        return f"{self.plural}.{self.group}"


BACKENDS: dict[str, BackendNeeds] = {b.backend: b for b in (
    BackendNeeds("PyTorchJob", "kubeflow.org", "v1", "pytorchjobs",
                 "the Kubeflow training-operator v1 (its CRDs and controller: "
                 "manifests/overlays/standalone of github.com/kubeflow/training-operator)"),
    BackendNeeds("JobSet", "jobset.x-k8s.io", "v1alpha2", "jobsets",
                 "JobSet (its CRDs and controller: the manifests.yaml of a release of "
                 "github.com/kubernetes-sigs/jobset)"),
    BackendNeeds("TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs",
                 "Kubeflow Trainer v2.3 (its CRDs, controller and webhooks, with JobSet) and the chart's "
                 "ClusterTrainingRuntime (trainingRuntime.enabled=true)"),
)}

ROLLOUT_NEEDS: dict[str, BackendNeeds] = {"LeaderWorkerSet": BackendNeeds(
    "LeaderWorkerSet", "leaderworkerset.x-k8s.io", "v1", "leaderworkersets",
    "LeaderWorkerSet (its CRD, controller and webhooks: the manifests.yaml of a release of "
    "github.com/kubernetes-sigs/lws)")}
"""What a job's rollout servers need beyond its backend, by workload kind: LeaderWorkerSet for
`rollout.nodesPerServer` > 1 (with any backend that has rollout servers of its own)."""

KUEUE_GROUP = "kueue.x-k8s.io"
"""Kueue is installed when the API server serves its group."""


def installed(groups: set[str], resources: Callable[[str, str], set[str] | None]) -> dict[str, bool]:
    """Which backends a cluster has, and Kueue: `groups` the API groups it serves,
    `resources(group, version)` the plurals of one group version (None: not served)."""
    out = {b.backend: b.group in groups and b.plural in (resources(b.group, b.version) or set())
           for b in BACKENDS.values()}
    out["Kueue"] = KUEUE_GROUP in groups
    return out


def missing_message(backend: str) -> str:
    """What a job of `backend` (or with rollout servers of a ROLLOUT_NEEDS kind) says when the
    cluster lacks its CRD."""
    if backend in ROLLOUT_NEEDS:
        needs = ROLLOUT_NEEDS[backend]
        return (f"rollout.nodesPerServer above 1: the cluster has no {needs.crd} CRD; install {needs.install}, "
                "or set rollout.nodesPerServer: 1")
    needs = BACKENDS[backend]
    others = [b for b in BACKENDS if b != backend]
    return (f"spec.backend {backend}: the cluster has no {needs.crd} CRD; install {needs.install}, "
            f"or choose another spec.backend ({', '.join(others)}) that the cluster has")
