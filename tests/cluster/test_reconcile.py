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


def test_a_child_the_api_server_refuses_is_a_warning_event_and_a_condition_not_a_silent_loop(cluster: Cluster):
    """A `spec.pod.volumes` entry the CRD keeps as written but Kubernetes refuses (two volume
    sources): the StatefulSet's apply gets a 422; the job shows the server's message in a
    `ChildRefused` condition and one Warning event, and the next reconciles neither post it
    again nor create the trainer (spec.pod cannot change: the job waits to be deleted)."""
    from rlhf_operator.kube import Kube
    from rlhf_operator.reconcile import Reconciler

    install_crd(cluster)
    ns = new_namespace(cluster, "refused")
    doc = job_doc("bad")
    doc["spec"]["pod"]["volumes"] = [{"name": "work", "emptyDir": {}, "configMap": {"name": "x"}}]
    try:
        with cluster.api_client() as api:
            r = Reconciler(Kube(api))
            cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
            for _ in range(3):
                r.reconcile(ns, "bad")
            st = cluster.get("rlhfjob", "bad", namespace=ns)["status"]
            cond = next(c for c in st["conditions"] if c["type"] == "ChildRefused")
            assert cond["status"] == "True" and cond["reason"] == "Invalid"
            assert cond["message"].startswith("StatefulSet bad-rollout refused by the API server: ")
            assert "may not specify more than 1 volume type" in cond["message"]
            assert st["message"] == cond["message"]
            events = [e for e in cluster.get("events", namespace=ns)["items"]
                      if e["involvedObject"]["name"] == "bad" and e["reason"] == "ChildRefused"]
            assert len(events) == 1 and events[0]["type"] == "Warning" and events[0].get("count", 1) == 1
            assert "may not specify more than 1 volume type" in events[0]["message"]
            assert cluster.kubectl("get", "pytorchjob", "bad-trainer", "-n", ns, check=False).returncode != 0

    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_helm_test_command_passes_with_an_operator_and_says_what_is_missing_without(cluster: Cluster, tmp_path):
    """`rlhfctl smoke-test` (the chart's `helm test` pod): a suspended job's children appear
    and it is reported Suspended while a real operator runs; with none, it fails in its
    timeout naming what is missing. Either way the job is deleted."""
    import subprocess
    import sys

    from .test_operator import operator

    install_crd(cluster)
    ns = new_namespace(cluster, "smoke")

    def smoke(timeout: int):
        return subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "smoke-test", "--namespace", ns,
                               "--timeout", str(timeout)], env=cluster.env, capture_output=True, text=True,
                              timeout=timeout + 60)

    try:
        alone = smoke(3)
        assert alone.returncode == 1 and "missing children: ConfigMap rlhf-smoke-test-config" in alone.stdout
        with operator(cluster, ns, tmp_path / "operator.log"):
            out = smoke(90)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "reports the job Suspended" in out.stdout
        gone = cluster.kubectl("get", "rlhfjob", "rlhf-smoke-test", "-n", ns, check=False)
        assert gone.returncode != 0 or "deletionTimestamp" in gone.stdout
        # A team's own job under that name (no helm-test label) is never deleted by the smoke test.
        wait_for(lambda: cluster.kubectl("get", "rlhfjob", "rlhf-smoke-test", "-n", ns, check=False).returncode != 0,
                 60, "the smoke test's job gone")
        from rlhf_operator.smoke import smoke_job
        theirs = smoke_job("rlhf-smoke-test")
        del theirs["metadata"]["labels"]
        theirs["metadata"]["namespace"] = ns
        cluster.apply(theirs)
        uid = cluster.get("rlhfjob", "rlhf-smoke-test", namespace=ns)["metadata"]["uid"]
        refused = smoke(3)
        assert refused.returncode == 1 and "not deleting it" in refused.stdout, refused.stdout + refused.stderr
        assert cluster.get("rlhfjob", "rlhf-smoke-test", namespace=ns)["metadata"]["uid"] == uid
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_backend_whose_crd_the_cluster_lacks_is_a_condition_naming_it(cluster: Cluster, monkeypatch):
    """Backend TrainJob on a cluster without Kubeflow Trainer's CRDs: the create is a 404; the
    job shows `BackendMissing` naming the CRD and what installs it (message and one Warning
    event), reconciles do not ask again within a minute, and once the CRD is installed the
    TrainJob is created and the condition turns False."""
    from rlhf_operator import reconcile
    from rlhf_operator.kube import Kube
    from rlhf_operator.reconcile import Reconciler

    from . import trainer_v2

    crd = "trainjobs.trainer.kubeflow.org"
    if cluster.kubectl("get", "crd", crd, check=False).returncode == 0:
        pytest.skip(f"{crd} is installed on this cluster already (an earlier test)")
    install_crd(cluster)
    ns = new_namespace(cluster, "nocrd")
    doc = job_doc("tj", backend="TrainJob")
    doc["spec"]["pod"]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    doc["spec"].update(model={"path": "/work/models/tiny"}, data={"path": "/work/data/train.jsonl"},
                       output={"dir": "/work/output"})
    installed = None
    try:
        with cluster.api_client() as api:
            kube = Kube(api)
            calls = []
            apply = kube.apply
            monkeypatch.setattr(kube, "apply", lambda obj, uid=None: (calls.append(obj["kind"]), apply(obj, uid))[1])
            r = Reconciler(kube)
            cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
            for _ in range(3):
                assert r.reconcile(ns, "tj") == "Pending"
            assert calls.count("TrainJob") == 1  # asked once, not on every reconcile
            st = cluster.get("rlhfjob", "tj", namespace=ns)["status"]
            cond = next(c for c in st["conditions"] if c["type"] == "BackendMissing")
            assert cond["status"] == "True" and cond["reason"] == "CRDNotFound"
            assert f"no {crd} CRD; install Kubeflow Trainer v2.3" in cond["message"]
            assert st["message"] == cond["message"]
            events = [e for e in cluster.get("events", namespace=ns)["items"]
                      if e["involvedObject"]["name"] == "tj" and e["reason"] == "BackendMissing"]
            assert len(events) == 1 and events[0]["type"] == "Warning"

            bin_dir = trainer_v2.built()
            if bin_dir is None:
                return  # the second half needs Trainer's CRD (`make trainer-bin`)
            installed = bin_dir / "crds" / "trainer.kubeflow.org_trainjobs.yaml"
            cluster.kubectl("apply", "--server-side", "-f", str(installed))
            cluster.wait_established(crd)
            monkeypatch.setattr(reconcile, "APPLY_CACHE_SECONDS", 0.0)  # the minute has passed
            wait_for(lambda: r.reconcile(ns, "tj") and cluster.kubectl(
                "get", "trainjob", "tj-trainer", "-n", ns, check=False).returncode == 0, 60, "the TrainJob created")
            r.reconcile(ns, "tj")
            cond = next(c for c in cluster.get("rlhfjob", "tj", namespace=ns)["status"]["conditions"]
                        if c["type"] == "BackendMissing")
            assert (cond["status"], cond["reason"]) == ("False", "Installed")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if installed is not None:  # as it was: later tests install Trainer with its controller and webhooks
            cluster.kubectl("delete", "crd", crd, "--wait=false", check=False)
