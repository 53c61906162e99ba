"""Ownership before write (operator/rlhf_operator/ownership.py and the reconcile's apply and
delete, over a recording stand-in for kube.py): what is read, written and deleted when a
child's name holds the job's object, nobody's, someone else's or an earlier job's; and
the messages that reach status and events without URL credentials."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from kubernetes.client.rest import ApiException

from rlhf_operator.conditions import conflict_condition
from rlhf_operator.ownership import conflict, controlled_by, earlier_job
from rlhf_operator.reconcile import CONFLICT, REFUSED, JobCache, Reconciler, status_view
from rlhf_operator.status import Observed

UID = "job-uid"
NOW = datetime(2026, 11, 28, tzinfo=timezone.utc)


def ref(kind: str, name: str, uid: str, controller: bool = True) -> dict:
    return {"apiVersion": "x/v1", "kind": kind, "name": name, "uid": uid, "controller": controller}


def obj(kind: str, name: str, uid: str = "obj-uid", owners: list | None = None) -> dict:
    meta = {"name": name, "namespace": "ns", "uid": uid, "labels": {"rlhf.dev/job": "j"}}
    if owners is not None:
        meta["ownerReferences"] = owners
    return {"apiVersion": "v1", "kind": kind, "metadata": meta}


def manifest(kind: str = "ConfigMap", name: str = "j-config") -> dict:
    return {"apiVersion": "v1", "kind": kind, "data": {"a": "1"},
            "metadata": {"name": name, "namespace": "ns", "labels": {"rlhf.dev/job": "j"},
                         "ownerReferences": [ref("RLHFJob", "j", UID)]}}


class RecordingKube:
    """kube.py's calls the reconcile makes while applying and deleting, recorded; `objects`
    is what the API server holds, by (kind, name)."""

    def __init__(self, objects: dict | None = None):
        self.objects = dict(objects or {})
        self.calls: list[tuple] = []

    def get(self, o):
        self.calls.append(("get", o["kind"], o["metadata"]["name"]))
        return self.objects.get((o["kind"], o["metadata"]["name"]))

    def apply(self, o, uid=None):
        self.calls.append(("apply", o["kind"], o["metadata"]["name"], uid))
        held = self.objects.get((o["kind"], o["metadata"]["name"]))
        if uid and held is None:
            raise ApiException(status=409, reason="Conflict")
        if uid and held["metadata"]["uid"] != uid:
            err = ApiException(status=422, reason="Invalid")
            err.body = json.dumps({"message": "metadata.uid: Invalid value: field is immutable"})
            raise err
        written = {**o, "metadata": {**o["metadata"], "uid": uid or "new-uid"}}
        self.objects[(o["kind"], o["metadata"]["name"])] = written
        return written

    def delete(self, kind, namespace, name, uid=None, body=None):
        self.calls.append(("delete", kind, name, uid))
        return True


def reconciler(kube: RecordingKube) -> tuple[Reconciler, JobCache]:
    r = Reconciler(kube)
    cache = r.caches.get(("ns", "j"))
    cache.uid = UID
    return r, cache


def test_whose_an_object_is():
    mine = obj("ConfigMap", "j-config", owners=[ref("RLHFJob", "j", UID)])
    assert controlled_by(mine, UID) and not controlled_by(mine, "")
    assert not controlled_by(obj("ConfigMap", "j-config", owners=[ref("RLHFJob", "j", UID, controller=False)]), UID)
    old = obj("ConfigMap", "j-config", owners=[ref("RLHFJob", "j", "earlier")])
    assert not controlled_by(old, UID) and earlier_job(old, "j") and not earlier_job(old, "k")
    nobody = obj("NetworkPolicy", "default-deny")
    assert conflict(nobody, "default-deny") == (
        "NetworkPolicy default-deny already exists and is not this job's (controlled by no object); the operator "
        "leaves it untouched: delete it, or create the job under another name than 'default-deny'")
    assert "(controlled by Deployment web)" in conflict(obj("Service", "s", owners=[ref("Deployment", "web", "d")]), "j")


def test_a_name_held_by_nobodys_object_is_read_once_never_written_and_reported():
    kube = RecordingKube({("ConfigMap", "j-config"): obj("ConfigMap", "j-config")})
    r, cache = reconciler(kube)
    second = manifest("ServiceAccount", "j-trainer")
    outcome = r._apply_all(cache, [manifest(), second], Observed())
    assert outcome == {CONFLICT: conflict(kube.objects[("ConfigMap", "j-config")], "j")}
    assert kube.calls == [("get", "ConfigMap", "j-config")]  # nothing after it is even read
    assert r._apply_all(cache, [manifest(), second], Observed()) == outcome
    assert len(kube.calls) == 1  # remembered like a refusal: no read per reconcile


def test_an_absent_name_is_created_then_applied_by_its_uid():
    kube = RecordingKube()
    r, cache = reconciler(kube)
    assert r._apply_all(cache, [manifest()], Observed()) == {}
    assert kube.calls == [("get", "ConfigMap", "j-config"), ("apply", "ConfigMap", "j-config", None)]
    changed = {**manifest(), "data": {"a": "2"}}
    assert r._apply_all(cache, [changed], Observed()) == {}
    assert kube.calls[-1] == ("apply", "ConfigMap", "j-config", "new-uid")  # no second read


def test_the_jobs_own_object_found_is_applied_by_its_uid():
    mine = obj("ConfigMap", "j-config", uid="mine", owners=[ref("RLHFJob", "j", UID)])
    kube = RecordingKube({("ConfigMap", "j-config"): mine})
    r, cache = reconciler(kube)
    assert r._apply_all(cache, [manifest()], Observed()) == {}
    assert kube.calls[-1] == ("apply", "ConfigMap", "j-config", "mine")


def test_a_replaced_object_is_refused_by_uid_read_again_and_left_alone():
    kube = RecordingKube()
    r, cache = reconciler(kube)
    r._apply_all(cache, [manifest()], Observed())
    kube.objects[("ConfigMap", "j-config")] = obj("ConfigMap", "j-config", uid="theirs")  # deleted, recreated
    outcome = r._apply_all(cache, [{**manifest(), "data": {"a": "2"}}], Observed())
    assert CONFLICT in outcome
    assert kube.calls[-2:] == [("apply", "ConfigMap", "j-config", "new-uid"), ("get", "ConfigMap", "j-config")]
    assert kube.objects[("ConfigMap", "j-config")]["metadata"]["uid"] == "theirs"


def test_an_earlier_jobs_object_is_waited_for_without_a_conflict():
    kube = RecordingKube({("ConfigMap", "j-config"): obj("ConfigMap", "j-config", owners=[ref("RLHFJob", "j", "old")])})
    r, cache = reconciler(kube)
    assert r._apply_all(cache, [manifest(), manifest("Role", "j-trainer")], Observed()) == {}
    assert [c[0] for c in kube.calls] == ["get"]
    r._apply_all(cache, [manifest()], Observed())
    assert [c[0] for c in kube.calls] == ["get", "get"]  # read again: the garbage collector removes it


def test_an_observed_workload_of_the_job_needs_no_read():
    kube = RecordingKube()
    r, cache = reconciler(kube)
    sts = obj("StatefulSet", "j-rollout", uid="sts", owners=[ref("RLHFJob", "j", UID)])
    kube.objects[("StatefulSet", "j-rollout")] = sts
    assert r._apply_all(cache, [manifest("StatefulSet", "j-rollout")], Observed(statefulset=sts)) == {}
    assert kube.calls == [("apply", "StatefulSet", "j-rollout", "sts")]


def test_only_workloads_the_job_controls_are_deleted_each_by_its_uid():
    kube = RecordingKube()
    r, cache = reconciler(kube)
    observed = Observed(statefulset=obj("StatefulSet", "j-rollout", uid="sts", owners=[ref("RLHFJob", "j", UID)]),
                        pytorchjob=obj("PyTorchJob", "j-trainer", uid="ptj"),
                        jobset=obj("JobSet", "j", uid="js", owners=[ref("RLHFJob", "j", "earlier")]))
    conflicts = r._delete_workloads(cache, "j", ["StatefulSet", "PyTorchJob", "JobSet"], observed)
    assert kube.calls == [("delete", "StatefulSet", "j-rollout", "sts")]
    assert conflicts == [conflict(observed.pytorchjob, "j")]  # an earlier job's JobSet: the garbage collector's


def test_child_conflict_turns_true_once_and_false_when_resolved():
    conds = {}
    assert not conflict_condition(conds, None, NOW)
    assert conflict_condition(conds, "ConfigMap j-config already exists", NOW, 2)
    assert (conds["ChildConflict"]["status"], conds["ChildConflict"]["reason"]) == ("True", "NotOwned")
    assert not conflict_condition(conds, "ConfigMap j-config already exists", NOW, 2)  # no second event
    assert conflict_condition(conds, None, NOW, 2)
    assert (conds["ChildConflict"]["status"], conds["ChildConflict"]["reason"]) == ("False", "Resolved")


def test_status_and_refusals_carry_no_url_credentials():
    secret = "judge at https://user:hunter2@judge.example/v1?key=abc failed"
    view = status_view({"phase": "Pending", "message": secret,
                        "conditions": [{"type": "ChildRefused", "status": "True", "message": secret}]})
    assert "hunter2" not in json.dumps(view) and "abc" not in json.dumps(view)
    assert view["message"] == "judge at https://<redacted>@judge.example/v1?<redacted> failed"
    assert status_view(view) == view  # redacting twice changes nothing: no patch per reconcile

    class Refusing(RecordingKube):
        def apply(self, o, uid=None):
            err = ApiException(status=422, reason="Invalid")
            err.body = json.dumps({"message": f"env value {secret}"})
            raise err

    r, cache = reconciler(Refusing())
    outcome = r._apply_all(cache, [manifest()], Observed())
    assert "hunter2" not in outcome[REFUSED] and "judge.example" in outcome[REFUSED]


def test_events_carry_no_url_credentials():
    from rlhf_operator.kube import Kube

    sent = []
    kube = Kube.__new__(Kube)
    kube.request = lambda method, path, body=None, **_: sent.append(body) or ({}, 201)
    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j", "namespace": "ns"}}
    kube.event(job, "Warning", "ChildRefused", "GET https://u:p@h.example/x?token=t returned 401")
    assert sent[0]["message"] == "GET https://<redacted>@h.example/x?<redacted> returned 401"


@pytest.mark.parametrize("status_code", [404, 409])
def test_a_delete_of_a_gone_or_replaced_object_is_no_error(status_code):
    from rlhf_operator.kube import Kube

    sent = []

    def request(method, path, body=None, **_):
        sent.append(body)
        raise ApiException(status=status_code, reason="x")

    kube = Kube.__new__(Kube)
    kube.request = request
    assert kube.delete("ConfigMap", "ns", "j-config", "uid-1") is False
    assert sent[0]["preconditions"] == {"uid": "uid-1"} and sent[0]["propagationPolicy"] == "Background"
    assert kube.force_delete_pod("ns", "p", "uid-2") is False
    assert sent[1] == {"propagationPolicy": "Background", "gracePeriodSeconds": 0, "preconditions": {"uid": "uid-2"}}


def test_a_support_statefulset_is_not_mistaken_for_the_missing_rollout_workload():
    """The judge's StatefulSet `<job>-judge` is applied like any support child (cached), not
    re-read and re-applied on every reconcile because the rollout StatefulSet is missing."""
    kube = RecordingKube()
    r, cache = reconciler(kube)
    judge = manifest("StatefulSet", "j-judge")
    r._apply_all(cache, [judge], Observed())
    r._apply_all(cache, [judge], Observed())
    assert kube.calls == [("get", "StatefulSet", "j-judge"), ("apply", "StatefulSet", "j-judge", None)]
    rollout = manifest("StatefulSet", "j-rollout")
    r._apply_all(cache, [rollout], Observed())
    r._apply_all(cache, [rollout], Observed())  # missing from what was observed: applied again, its name read again
    assert [c[0] for c in kube.calls[2:]] == ["get", "apply", "get", "apply"]


def test_a_steady_jobs_status_read_back_with_the_crds_defaults_is_not_patched_again():
    """The API server returns the status with the CRD's defaults (`disruptions: 0`,
    `completionTime: null`); compared against a plan's, which leaves them out, every reconcile
    of a steady job used to patch the status (the most expensive request at scale)."""
    from rlhf_contract.api.models import RLHFJobStatus

    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
           "metadata": {"name": "j", "namespace": "ns", "uid": UID, "generation": 1,
                        "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"model": {"path": "/w/m"}, "data": {"path": "/w/d"}, "rollout": {"replicas": 1},
                    "trainer": {"numNodes": 1}, "output": {"dir": "/w/o"},
                    "pod": {"volumes": [{"name": "w", "emptyDir": {}}], "volumeMounts": [{"name": "w", "mountPath": "/w"}]}}}
    owned = [ref("RLHFJob", "j", UID)]

    def pod(name, role):
        return {"metadata": {"name": name, "uid": name, "labels": {"rlhf.dev/job": "j", "rlhf.dev/job-uid": UID,
                                                                  "rlhf.dev/role": role, "rlhf.dev/attempt": "0"}},
                "spec": {"nodeName": "n"}, "status": {"phase": "Running",
                                                      "conditions": [{"type": "Ready", "status": "True"}]}}

    def workload(name):
        return {"metadata": {"name": name, "namespace": "ns", "uid": name, "labels": {"rlhf.dev/attempt": "0"},
                             "ownerReferences": owned}}

    class ApiServer(RecordingKube):
        patches = 0

        def get_job(self, ns, name):
            return json.loads(json.dumps(job))

        def observe(self, ns, name, backend):
            return Observed(statefulset=workload("j-rollout"), pytorchjob=workload("j-trainer"),
                            pods=[pod("r0", "rollout"), pod("t0", "trainer")])

        def patch_status(self, ns, name, st):
            self.patches += 1
            merged = {**(job.get("status") or {}), **json.loads(json.dumps(st))}  # a merge patch: null removes
            merged["progress"] = {k: v for k, v in (merged.get("progress") or {}).items() if v is not None}
            job["status"] = RLHFJobStatus.model_validate(merged).model_dump(by_alias=True, mode="json")

        def event(self, *_):
            pass

    kube = ApiServer()
    r = Reconciler(kube)
    assert [r.reconcile("ns", "j") for _ in range(3)] == ["Running"] * 3
    assert job["status"]["disruptions"] == 0 and job["status"]["completionTime"] is None  # as the API server has it
    assert kube.patches == 1
