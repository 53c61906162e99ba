"""What each backend (`spec.backend`) needs installed on a cluster, named once: the CRD the
operator creates its workload through, and what installs it. The operator turns a missing
CRD into the job's `BackendMissing` condition; `rlhfctl env` lists what a cluster has and
`rlhfctl submit` refuses a job whose backend is missing. Kueue's presence is read from its
Workload CRD.

Not checked: that the CRD's controller runs (a CRD without its controller leaves the
workload unreconciled, which the job's phase shows), or its version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendNeeds:
    backend: str
    crd: str
    """`<plural>.<group>` of the workload's CustomResourceDefinition."""
    install: str
    """What to install, as a user reads it."""


BACKENDS: dict[str, BackendNeeds] = {b.backend: b for b in (
    BackendNeeds("PyTorchJob", "pytorchjobs.kubeflow.org",
                 "the Kubeflow training-operator v1 (its CRDs and controller: "
                 "manifests/overlays/standalone of github.com/kubeflow/training-operator)"),
    BackendNeeds("JobSet", "jobsets.jobset.x-k8s.io",
                 "JobSet (its CRDs and controller: the manifests.yaml of a release of "
                 "github.com/kubernetes-sigs/jobset)"),
    BackendNeeds("TrainJob", "trainjobs.trainer.kubeflow.org",
                 "Kubeflow Trainer v2.3 (its CRDs, controller and webhooks, with JobSet) and the chart's "
                 "ClusterTrainingRuntime (trainingRuntime.enabled=true)"),
)}

KUEUE_CRD = "workloads.kueue.x-k8s.io"
"""Kueue is installed when its Workload CRD is."""


def missing_message(backend: str) -> str:
    """What a job of `backend` says when the cluster lacks its CRD."""
    needs = BACKENDS[backend]
    others = [b for b in BACKENDS if b != backend]
    return (f"spec.backend {backend}: the cluster has no {needs.crd} CRD; install {needs.install}, "
            f"or choose another spec.backend ({', '.join(others)}) that the cluster has")
