"""A backend whose CRD the cluster lacks (the workload's create is a 404): the reconcile's
apply remembers it as a problem (`BackendMissing`, naming the CRD and what installs it),
asks the API server again once a minute rather than on every reconcile, and clears the
condition once the workload is written."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from rlhf_contract.backends import BACKENDS, missing_message
from rlhf_operator.conditions import CONDITION_TYPES, missing_condition
from rlhf_operator.reconcile import MISSING, Reconciler
from rlhf_operator.status import Observed
from test_ownership import NOW, RecordingKube, manifest, reconciler


class NoCRDKube(RecordingKube):
    """The API server without the CRDs of `kinds`: a create of one is a 404."""

    def __init__(self, kinds: set[str]):
        super().__init__()
        self.kinds = kinds

    def apply(self, o, uid=None):
        if o["kind"] in self.kinds:
            self.calls.append(("apply", o["kind"], o["metadata"]["name"], uid))
            raise ApiException(status=404, reason="Not Found")
        return super().apply(o, uid)


@pytest.mark.parametrize("backend, crd", [("PyTorchJob", "pytorchjobs.kubeflow.org"),
                                          ("JobSet", "jobsets.jobset.x-k8s.io"),
                                          ("TrainJob", "trainjobs.trainer.kubeflow.org")])
def test_a_missing_backend_crd_is_a_problem_naming_it_asked_again_once_a_minute(backend, crd, monkeypatch):
    kube = NoCRDKube({backend})
    r, cache = reconciler(kube)
    workload = manifest(backend, "j-trainer" if backend != "JobSet" else "j")
    outcome = r._apply_all(cache, [manifest(), workload], Observed())
    assert outcome == {MISSING: missing_message(backend)}
    assert f"no {crd} CRD; install " in outcome[MISSING] and BACKENDS[backend].install in outcome[MISSING]
    calls = len(kube.calls)
    # The next reconciles (a missing workload is otherwise applied every time): no request.
    assert r._apply_all(cache, [manifest(), workload], Observed()) == outcome
    assert len(kube.calls) == calls
    # A minute on, asked again; the CRD installed since: written, no problem.
    monkeypatch.setattr("rlhf_operator.reconcile.APPLY_CACHE_SECONDS", 0.0)
    kube.kinds = set()
    assert r._apply_all(cache, [manifest(), workload], Observed()) == {}
    assert kube.calls[-1][:3] == ("apply", backend, workload["metadata"]["name"])


def test_another_404_is_not_taken_for_a_missing_crd():
    kube = NoCRDKube({"ConfigMap"})
    r, cache = reconciler(kube)
    with pytest.raises(ApiException):
        r._apply_all(cache, [manifest()], Observed())


def test_backend_missing_turns_true_once_and_false_when_installed():
    conds = {}
    assert not missing_condition(conds, None, NOW)
    assert missing_condition(conds, missing_message("JobSet"), NOW, 1)
    assert (conds["BackendMissing"]["status"], conds["BackendMissing"]["reason"]) == ("True", "CRDNotFound")
    assert not missing_condition(conds, missing_message("JobSet"), NOW, 1)  # no second event
    assert missing_condition(conds, None, NOW, 1)
    assert (conds["BackendMissing"]["status"], conds["BackendMissing"]["reason"]) == ("False", "Installed")
    assert "BackendMissing" in CONDITION_TYPES  # kept by status.plan and the report


def test_the_report_sets_the_condition_and_the_message_once():
    patched, events = [], []

    class Kube(RecordingKube):
        def patch_status(self, ns, name, st):
            patched.append(st)

        def event(self, body, type_, reason, message):
            events.append((type_, reason, message))

    r = Reconciler(Kube())
    body = {"metadata": {"namespace": "ns", "name": "j", "generation": 1}}
    status = {"phase": "Pending", "conditions": []}
    r._report(body, status, {MISSING: missing_message("TrainJob")})
    assert patched[-1]["message"] == missing_message("TrainJob")
    assert [c["type"] for c in patched[-1]["conditions"]] == ["BackendMissing"]
    assert events == [("Warning", "BackendMissing", missing_message("TrainJob"))]
    r._report(body, patched[-1], {MISSING: missing_message("TrainJob")})
    assert len(events) == 1


def test_which_backends_a_cluster_has_is_read_from_api_discovery():
    from rlhf_contract.backends import installed

    served = {("kubeflow.org", "v1"): {"pytorchjobs", "pytorchjobs/status", "tfjobs"},
              ("jobset.x-k8s.io", "v1alpha2"): {"jobsets"}}
    groups = {"apps", "kubeflow.org", "jobset.x-k8s.io", "kueue.x-k8s.io"}
    assert installed(groups, lambda g, v: served.get((g, v))) == {
        "PyTorchJob": True, "JobSet": True, "TrainJob": False, "Kueue": True}
    # a group served without our version or resource (Kubeflow's other operators) is not the backend
    assert not installed({"kubeflow.org"}, lambda g, v: {"tfjobs"})["PyTorchJob"]
    assert not installed({"trainer.kubeflow.org"}, lambda g, v: None)["TrainJob"]


def test_a_missing_leaderworkerset_crd_is_the_same_problem_naming_it_and_nodes_per_server():
    """rollout.nodesPerServer > 1 with any backend: the rollout LeaderWorkerSet's 404 is BackendMissing."""
    kube = NoCRDKube({"LeaderWorkerSet"})
    r, cache = reconciler(kube)
    outcome = r._apply_all(cache, [manifest(), manifest("LeaderWorkerSet", "j-rollout")], Observed())
    assert outcome == {MISSING: missing_message("LeaderWorkerSet")}
    assert "no leaderworkersets.leaderworkerset.x-k8s.io CRD" in outcome[MISSING]
    assert "rollout.nodesPerServer: 1" in outcome[MISSING]
