"""The reconcile in-process against the real API server: the per-job cache lives exactly
as long as the job."""

from __future__ import annotations

import pytest
import yaml

from .harness import Cluster, wait_for
from .test_admission import install_crd
from .test_operator import job_doc, new_namespace

pytestmark = pytest.mark.cluster


def test_job_cache_is_created_with_the_job_and_dropped_with_it(cluster: Cluster):
    from rlhf_operator.kube import Kube
    from rlhf_operator.reconcile import Reconciler

    install_crd(cluster)
    ns = new_namespace(cluster, "cache")
    try:
        with cluster.api_client() as api:
            r = Reconciler(Kube(api))
            cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(job_doc("c1")))
            assert r.reconcile(ns, "c1") == "Pending"
            cache = r.caches.get((ns, "c1"))
            assert cache.uid == cluster.get("rlhfjob", "c1", namespace=ns)["metadata"]["uid"]
            assert ("ConfigMap", "c1-config") in cache.applied and ("PyTorchJob", "c1-trainer") in cache.applied
            assert cluster.kubectl("get", "configmap", "c1-config", "-n", ns, check=False).returncode == 0

            # A job deleted and created again under the same name starts with a fresh cache.
            cluster.kubectl("delete", "rlhfjob", "c1", "-n", ns)
            assert r.reconcile(ns, "c1") is None and len(r.caches) == 0
            cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(job_doc("c1")))
            wait_for(lambda: r.reconcile(ns, "c1") in ("Pending", "Initializing", "Running"), 30, "reconciled")
            assert r.caches.get((ns, "c1")).uid == cluster.get("rlhfjob", "c1", namespace=ns)["metadata"]["uid"]
            cluster.kubectl("delete", "rlhfjob", "c1", "-n", ns)
            r.forget((ns, "c1"))  # what the DELETED watch event does
            assert (ns, "c1") not in r.caches
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
