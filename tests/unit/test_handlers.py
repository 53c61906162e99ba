"""The kopf wiring: what the operator asks the API server to send it."""

from __future__ import annotations

import kopf
import pytest
from kopf._cogs.structs.references import Resource

from rlhf_operator.builders import LABEL_JOB
from rlhf_operator.handlers import _configure


def test_pod_and_pytorchjob_watches_are_filtered_by_the_api_server():
    settings = kopf.OperatorSettings()
    _configure(settings=settings)
    pods = Resource("", "v1", "pods", kind="Pod", namespaced=True)
    ptjs = Resource("kubeflow.org", "v1", "pytorchjobs", kind="PyTorchJob", namespaced=True)
    jobs = Resource("rlhf.dev", "v1alpha1", "rlhfjobs", kind="RLHFJob", namespaced=True)
    # kopf joins these into the watch's labelSelector (an existence selector: "rlhf.dev/job").
    assert list(settings.watching.label_selectors.collect(pods)) == [LABEL_JOB]
    assert list(settings.watching.label_selectors.collect(ptjs)) == [LABEL_JOB]
    assert list(settings.watching.label_selectors.collect(jobs)) == []


def test_every_child_kind_is_watched_through_the_job_label_selector():
    from rlhf_operator.kube import CHILD_KINDS

    settings = kopf.OperatorSettings()
    _configure(settings=settings)
    for ck in CHILD_KINDS:
        res = Resource(ck.group, ck.version, ck.plural, kind=ck.kind, namespaced=True)
        assert list(settings.watching.label_selectors.collect(res)) == [LABEL_JOB], ck.kind
    assert {ck.plural for ck in CHILD_KINDS} >= {"pods", "statefulsets", "pytorchjobs", "jobsets"}


def _obj(name: str, created: str = "2026-01-01T00:00:00Z", node: str | None = None) -> dict:
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": {"nodeName": node} if node else {}}


def test_observed_children_are_the_backends_kinds_by_their_fixed_names():
    """What a reconcile sees from the per-kind objects of one job (an index's or the API's)."""
    from rlhf_operator.kube import observed_of

    objs = {"pods": [_obj("j-trainer-0", node="n1"), _obj("j-rollout-0", node="n2"), _obj("j-rollout-1")],
            "statefulsets": [_obj("j-rollout")],
            # the deleted trainer of attempt 0 still indexed beside attempt 1's: the newer one counts
            "pytorchjobs": [_obj("j-trainer", "2026-01-01T00:05:00Z"), _obj("j-trainer", "2026-01-01T00:00:00Z")],
            "jobsets": [_obj("j")], "leaderworkersets": [_obj("j-rollout")]}
    read: list[str] = []
    asked: list[set[str]] = []

    def reader(ck):
        read.append(ck.plural)
        return objs[ck.plural]

    def not_ready(nodes: set[str]) -> dict:
        asked.append(nodes)
        return {}

    o = observed_of("ns", "j", "PyTorchJob", reader, not_ready)
    # not the other backend's JobSet; the rollout servers' LeaderWorkerSet (rollout.nodesPerServer > 1)
    assert sorted(read) == ["leaderworkersets", "pods", "pytorchjobs", "statefulsets"]
    assert o.statefulset["metadata"]["name"] == "j-rollout" and o.jobset is None
    assert o.leaderworkerset["metadata"]["name"] == "j-rollout"
    assert o.pytorchjob["metadata"]["creationTimestamp"] == "2026-01-01T00:05:00Z"
    assert [p["metadata"]["name"] for p in o.pods] == ["j-trainer-0", "j-rollout-0", "j-rollout-1"]
    assert asked == [{"n1", "n2"}]

    read.clear()
    o = observed_of("ns", "j", "JobSet", reader, not_ready)
    assert sorted(read) == ["jobsets", "pods"] and o.jobset["metadata"]["name"] == "j"
    assert o.statefulset is None and o.pytorchjob is None and o.leaderworkerset is None
    # an object of another name (another job's child that shares no key) is not this job's
    objs["statefulsets"] = [_obj("other-rollout")]
    assert observed_of("ns", "j", "PyTorchJob", reader, not_ready).statefulset is None


def test_a_nodes_readiness_from_the_index_entry_it_keeps():
    from datetime import datetime, timezone

    from rlhf_operator.kube import node_readiness, not_ready

    def node(name: str, ready: str | None, since: str = "2026-01-01T00:01:00Z") -> dict:
        conds = [{"type": "MemoryPressure", "status": "False"}]
        conds += [{"type": "Ready", "status": ready, "lastTransitionTime": since}] if ready else []
        return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z", "labels": {"a": "b"}},
                "spec": {"taints": []}, "status": {"conditions": conds, "images": ["x"] * 50}}

    index = {n["metadata"]["name"]: node_readiness(n) for n in (
        node("up", "True"), node("down", "False"), node("unknown", "Unknown", "2026-01-01T00:02:00Z"), node("new", None))}
    assert index["down"] == {"metadata": {"name": "down", "creationTimestamp": "2026-01-01T00:00:00Z"},
                             "status": {"conditions": [{"type": "Ready", "status": "False",
                                                        "lastTransitionTime": "2026-01-01T00:01:00Z"}]}}
    utc = timezone.utc
    assert not_ready({"up", "down", "unknown", "new", "gone"}, index.get) == {
        "down": datetime(2026, 1, 1, 0, 1, tzinfo=utc), "unknown": datetime(2026, 1, 1, 0, 2, tzinfo=utc),
        "new": datetime(2026, 1, 1, 0, 0, tzinfo=utc),  # no Ready condition yet: since its creation
        "gone": datetime.fromtimestamp(0, utc)}  # deleted: lost at once


@pytest.mark.parametrize("value, allowed", [(None, False), ("", False), ("0", False), ("false", False),
                                            ("1", True), ("true", True), ("True", True)])
def test_host_path_volumes_are_allowed_only_when_the_chart_says_so(monkeypatch, value, allowed):
    """`security.allowHostPath` sets RLHF_ALLOW_HOST_PATH=1 on the operator; the reconcile
    passes it to the builders, which refuse hostPath volumes without it."""
    from rlhf_operator.handlers import allow_host_path

    if value is None:
        monkeypatch.delenv("RLHF_ALLOW_HOST_PATH", raising=False)
    else:
        monkeypatch.setenv("RLHF_ALLOW_HOST_PATH", value)
    assert allow_host_path() is allowed
