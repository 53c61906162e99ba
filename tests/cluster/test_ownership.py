"""Ownership before write (issue 49), the reconcile in-process against the real API server:
an object with the name of a job's child that the job does not control is never changed,
adopted or deleted; the job waits with a `ChildConflict` condition and one Warning event
naming it, and goes on once the object is gone. Deletes and applies name the uid, so an
object replaced under the same name is left alone too."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from .harness import Cluster, wait_for
from .test_admission import install_crd
from .test_operator import job_doc, new_namespace

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "rlhf-operator"


def _snapshot(obj: dict) -> dict:
    """What must not move: everything but the server's bookkeeping of reads."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in ("managedFields",)}
    return {**obj, "metadata": meta}


def _events(cluster: Cluster, ns: str, job: str, reason: str) -> list[dict]:
    return [e for e in cluster.get("events", namespace=ns)["items"]
            if e["involvedObject"]["name"] == job and e["reason"] == reason]


def _exists(cluster: Cluster, kind: str, name: str, ns: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", ns, check=False).returncode == 0


def test_a_foreign_object_with_a_childs_name_is_left_alone_and_the_job_says_so(cluster: Cluster, monkeypatch):
    """A NetworkPolicy `default-deny` (a namespace's own) and a ServiceAccount `<job>-trainer`
    that nobody owns, a ConfigMap `<job>-config` owned by another object: each job that would
    take one over stays Pending with the condition and one event; the objects keep their
    resourceVersion, fields and owners, and outlive the job."""
    from rlhf_operator import reconcile
    from rlhf_operator.kube import Kube
    from rlhf_operator.reconcile import Reconciler

    install_crd(cluster)
    ns = new_namespace(cluster, "owner")
    anchor = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "anchor", "namespace": ns}}
    cluster.apply(anchor)
    anchor_uid = cluster.get("configmap", "anchor", namespace=ns)["metadata"]["uid"]
    foreign = {
        ("networkpolicy", "default-deny"): {
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny", "namespace": ns, "labels": {"team": "platform"}},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}},
        ("serviceaccount", "sa-job-trainer"): {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "sa-job-trainer", "namespace": ns}},
        ("configmap", "cm-job-config"): {
            "apiVersion": "v1", "kind": "ConfigMap", "data": {"keep": "me"},
            "metadata": {"name": "cm-job-config", "namespace": ns, "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "anchor", "uid": anchor_uid, "controller": True}]}},
    }
    cluster.apply(*foreign.values())
    before = {k: _snapshot(cluster.get(k[0], k[1], namespace=ns)) for k in foreign}
    blocked = {"default-deny": "NetworkPolicy default-deny", "sa-job": "ServiceAccount sa-job-trainer",
               "cm-job": "ConfigMap cm-job-config"}
    try:
        with cluster.api_client() as api:
            r = Reconciler(Kube(api))
            for job in blocked:
                cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(job_doc(job)))
            for _ in range(3):  # a permanent conflict: no more events, no writes, no progress
                for job in blocked:
                    assert r.reconcile(ns, job) == "Pending"
            after = {k: _snapshot(cluster.get(k[0], k[1], namespace=ns)) for k in foreign}
            assert after == before  # resourceVersion, labels, owners, spec: byte for byte
            for job, what in blocked.items():
                st = cluster.get("rlhfjob", job, namespace=ns)["status"]
                cond = next(c for c in st["conditions"] if c["type"] == "ChildConflict")
                assert cond["status"] == "True" and cond["reason"] == "NotOwned"
                assert cond["message"].startswith(f"{what} already exists and is not this job's"), cond["message"]
                assert f"another name than '{job}'" in cond["message"] and st["message"] == cond["message"]
                events = _events(cluster, ns, job, "ChildConflict")
                assert len(events) == 1 and events[0]["type"] == "Warning" and events[0]["message"] == cond["message"]
                assert not _exists(cluster, "pytorchjob", f"{job}-trainer", ns)  # nothing that relies on it runs
            owned_by_other = next(c for c in cluster.get("rlhfjob", "cm-job", namespace=ns)["status"]["conditions"]
                                  if c["type"] == "ChildConflict")
            assert "(controlled by ConfigMap anchor)" in owned_by_other["message"]
            # the trainer's RoleBinding would lend the job's rights to a ServiceAccount it does not own
            assert not _exists(cluster, "rolebinding", "sa-job-trainer", ns)
            assert _exists(cluster, "configmap", "sa-job-config", ns)  # what came before it is the job's own

            # The object goes: the job takes the name and goes on; the condition says resolved.
            cluster.kubectl("delete", "serviceaccount", "sa-job-trainer", "-n", ns)
            monkeypatch.setattr(reconcile, "APPLY_CACHE_SECONDS", 0.0)
            assert r.reconcile(ns, "sa-job") == "Pending"
            st = cluster.get("rlhfjob", "sa-job", namespace=ns)["status"]
            cond = next(c for c in st["conditions"] if c["type"] == "ChildConflict")
            assert (cond["status"], cond["reason"]) == ("False", "Resolved")
            sa = cluster.get("serviceaccount", "sa-job-trainer", namespace=ns)
            assert sa["metadata"]["ownerReferences"][0]["kind"] == "RLHFJob"
            assert _exists(cluster, "rolebinding", "sa-job-trainer", ns) and _exists(cluster, "pytorchjob",
                                                                                    "sa-job-trainer", ns)

            # The jobs go (the garbage collector removes their own children); the foreign objects stay.
            cluster.kubectl("delete", "rlhfjob", "default-deny", "cm-job", "-n", ns)
            for job in ("default-deny", "cm-job"):
                assert r.reconcile(ns, job) is None
            wait_for(lambda: not _exists(cluster, "configmap", "default-deny-config", ns), 60,
                     "the garbage collector removing the job's own ConfigMap")
            foreign.pop(("serviceaccount", "sa-job-trainer"))
            assert {k: _snapshot(cluster.get(k[0], k[1], namespace=ns)) for k in foreign} == {
                k: v for k, v in before.items() if k in foreign}
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_an_object_replaced_under_a_childs_name_is_neither_changed_nor_deleted(cluster: Cluster, monkeypatch):
    """The job's ConfigMap is deleted and someone else's created under its name: the next
    apply (naming the old uid) is refused by the API server, the name is read again, and the
    job reports the conflict; a delete with the old uid as precondition deletes nothing."""
    from rlhf_operator import reconcile
    from rlhf_operator.kube import Kube
    from rlhf_operator.reconcile import Reconciler

    install_crd(cluster)
    ns = new_namespace(cluster, "swap")
    try:
        with cluster.api_client() as api:
            kube = Kube(api)
            r = Reconciler(kube)
            cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(job_doc("swap")))
            assert r.reconcile(ns, "swap") == "Pending"
            ours = cluster.get("configmap", "swap-config", namespace=ns)["metadata"]["uid"]
            cluster.kubectl("delete", "configmap", "swap-config", "-n", ns)
            cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "data": {"theirs": "1"},
                           "metadata": {"name": "swap-config", "namespace": ns}})
            theirs = _snapshot(cluster.get("configmap", "swap-config", namespace=ns))

            assert kube.delete("ConfigMap", ns, "swap-config", ours) is False  # 409: another uid holds the name
            monkeypatch.setattr(reconcile, "APPLY_CACHE_SECONDS", 0.0)
            r.reconcile(ns, "swap")  # its workloads exist already: the phase follows their pods
            assert _snapshot(cluster.get("configmap", "swap-config", namespace=ns)) == theirs
            st = cluster.get("rlhfjob", "swap", namespace=ns)["status"]
            cond = next(c for c in st["conditions"] if c["type"] == "ChildConflict")
            assert cond["status"] == "True" and cond["message"].startswith("ConfigMap swap-config already exists")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_the_charts_admission_policies_hold_the_operators_service_account_to_adoption(cluster: Cluster):
    """The chart's ValidatingAdmissionPolicies, installed from `helm template`, against
    requests made as the operator's ServiceAccount (impersonated; RBAC grants it everything
    in the namespace, so a refusal is the policy's): adding a job's labels to its TrainJob's
    pod is admitted; a spec change, another label, a delete of a pod not a job's, and a
    change to a ConfigMap no RLHFJob controls are refused. An administrator is not held."""
    release = f"vap{uuid.uuid4().hex[:6]}"
    out = cluster.helm("template", release, str(CHART), "--namespace", "rlhf-system",
                       "--show-only", "templates/admission-policy.yaml", "--kube-version", "1.34.0")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted(d["kind"] for d in docs) == ["ValidatingAdmissionPolicy"] * 3 + ["ValidatingAdmissionPolicyBinding"] * 3
    ns = new_namespace(cluster, "vap", level="baseline")
    sa = f"system:serviceaccount:rlhf-system:{release}-rlhf-operator"
    try:
        cluster.kubectl("create", "rolebinding", "operator-all", "-n", ns, "--clusterrole=cluster-admin", f"--user={sa}")
        for name, labels in (("trainjob-pod", "jobset.sigs.k8s.io/jobset-name=j-trainer"), ("web", "app=web")):
            cluster.kubectl("run", name, "-n", ns, "--image=example.invalid/x:1", "--restart=Never", f"--labels={labels}")
        cluster.kubectl("create", "configmap", "theirs", "-n", ns, "--from-literal=a=1")
        cluster.apply(*docs)

        def as_operator(*args: str, patch: dict | None = None):
            extra = ["--type=merge", "-p", yaml.safe_dump(patch)] if patch is not None else []
            return cluster.kubectl(*args, "-n", ns, f"--as={sa}", *extra, check=False)

        adopt = {"metadata": {"labels": {"rlhf.dev/job": "j", "rlhf.dev/job-uid": "u", "rlhf.dev/attempt": "0"}}}
        # the policies take a moment to reach the API server's admission: wait for the first refusal
        # (a dry run: a patch admitted before then would make the next ones no-ops, never refused)
        wait_for(lambda: "may not change a pod's spec" in as_operator(
            "patch", "pod", "trainjob-pod", "--dry-run=server", patch={"spec": {"activeDeadlineSeconds": 5}}).stderr,
            60, "the policy")
        refused = {
            "a pod's spec": as_operator("patch", "pod", "trainjob-pod", patch={"spec": {"activeDeadlineSeconds": 5}}),
            "a pod's annotations": as_operator("patch", "pod", "trainjob-pod", patch={"metadata": {"annotations": {"a": "b"}}}),
            "another label": as_operator("patch", "pod", "web", patch={"metadata": {"labels": {"app": "db"}}}),
            "a job's label on a pod not its TrainJob's": as_operator("patch", "pod", "web", patch=adopt),
            "deleting a pod not a job's": as_operator("delete", "pod", "web", "--wait=false"),
            "a ConfigMap no RLHFJob controls": as_operator("patch", "configmap", "theirs", patch={"data": {"a": "2"}}),
            "deleting it": as_operator("delete", "configmap", "theirs"),
        }
        for what, result in refused.items():
            assert result.returncode != 0 and "ValidatingAdmissionPolicy" in result.stderr, what
        assert as_operator("patch", "pod", "trainjob-pod", patch=adopt).returncode == 0  # adoption
        assert as_operator("delete", "pod", "trainjob-pod", "--wait=false").returncode == 0  # now a job's pod
        assert as_operator("create", "configmap", "mine", "--from-literal=a=1").returncode == 0  # creating is RBAC's
        assert cluster.kubectl("patch", "configmap", "theirs", "-n", ns, "--type=merge", "-p", '{"data":{"a":"3"}}')
    finally:
        for d in docs:
            cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
