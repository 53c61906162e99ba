"""`rlhfctl smoke-test`: what the chart's `helm test` runs in the release namespace. It
creates a tiny suspended RLHFJob (so no pod asks for a GPU), waits until the operator has
created its children (the config, identity, services and network policy of a suspended
job) and reported the job Suspended, then deletes the job. Exit 0 when all of that happens
within the timeout, 1 (saying what is missing) otherwise.

It does not run a training step: that needs GPU nodes and the images (docs/cluster.md)."""

from __future__ import annotations

import time
from typing import Any, Callable

from rlhf_contract.api.models import API_GROUP, API_VERSION, KIND

from .backends import build_support
from .kube import Kube, api_path
from .reconcile import job_model


def smoke_job(name: str) -> dict[str, Any]:
    """A job the operator can lay out anywhere: built-in model and data, output on an
    emptyDir, suspended."""
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": "helm-test"}},
        "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
                 "suspend": True, "schedule": {"totalSteps": 1},
                 "pod": {"volumes": [{"name": "out", "emptyDir": {}}],
                         "volumeMounts": [{"name": "out", "mountPath": "/output"}]}},
    }


def run_smoke_test(kube: Kube, namespace: str, name: str, timeout_s: float = 120.0,
                   say: Callable[[str], None] = print) -> int:
    doc = smoke_job(name)
    path = api_path(doc["apiVersion"], KIND, namespace)
    old = kube.get_job(namespace, name)
    if old is not None:  # a previous run's is replaced; a job of anyone else's is never touched
        if (old["metadata"].get("labels") or {}).get("app.kubernetes.io/component") != "helm-test":
            say(f"RLHFJob {namespace}/{name} exists and is not a smoke test's (no label "
                "app.kubernetes.io/component=helm-test): not deleting it; give the smoke test another name")
            return 1
        kube.delete("RLHFJob", namespace, name, old["metadata"]["uid"])
    deadline = time.monotonic() + timeout_s
    while kube.get_job(namespace, name) is not None and time.monotonic() < deadline:
        time.sleep(1)
    created = kube.request("POST", path, body=doc)[0]
    say(f"created RLHFJob {namespace}/{name}")
    wanted = [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in build_support(job_model(created))]
    missing: list[str] = []
    phase = None
    try:
        while time.monotonic() < deadline:
            missing = [f"{k} {n}" for v, k, n in wanted if kube.read(api_path(v, k, namespace, n)) is None]
            phase = ((kube.get_job(namespace, name) or {}).get("status") or {}).get("phase")
            if not missing and phase == "Suspended":
                say(f"the operator created {len(wanted)} children and reports the job {phase}")
                return 0
            time.sleep(1)
        say(f"after {timeout_s:.0f} s: phase {phase or 'unset'}; missing children: {', '.join(missing) or 'none'} "
            "(is the operator running and watching this namespace? `kubectl logs` of its Deployment)")
        return 1
    finally:
        kube.delete("RLHFJob", namespace, name, created["metadata"]["uid"])  # this run's job, by uid
