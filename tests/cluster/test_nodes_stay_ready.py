"""The test cluster's nodes stay Ready as a real cluster's do: kwok renews their Leases,
so the node lifecycle controller never marks them NotReady. Runs last in the session
(marker `cluster_last`) and waits, if it must, until the nodes are 5 minutes old, so it
costs at most the time the other cluster tests have not already spent."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import pytest

from .harness import NODE_LEASE_SECONDS, Cluster

pytestmark = [pytest.mark.cluster, pytest.mark.cluster_last]

SOAK = 300.0


def _time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


def test_nodes_stay_ready_for_five_minutes_with_no_node_not_ready_event(cluster: Cluster):
    nodes = [n for n in cluster.get("nodes")["items"] if n["metadata"]["name"].startswith("kwok-node-")]
    assert nodes
    born = min(_time(n["metadata"]["creationTimestamp"]) for n in nodes)
    age = (datetime.now(timezone.utc) - born).total_seconds()
    if age < SOAK:
        time.sleep(SOAK - age + 1)
    names = {n["metadata"]["name"] for n in nodes}
    for n in cluster.get("nodes")["items"]:
        if n["metadata"]["name"] not in names:
            continue
        ready = next(c for c in n["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True", (n["metadata"]["name"], ready)
        # Ready since kwok initialised the node: it never went NotReady in between.
        assert (_time(ready["lastTransitionTime"]) - _time(n["metadata"]["creationTimestamp"])).total_seconds() < 30
        taints = [t["key"] for t in n["spec"].get("taints", [])]
        assert "node.kubernetes.io/not-ready" not in taints and "node.kubernetes.io/unreachable" not in taints
    now = datetime.now(timezone.utc)
    for lease in cluster.get("leases", namespace="kube-node-lease")["items"]:
        if lease["metadata"]["name"] in names:
            renewed = _time(lease["spec"]["renewTime"][:19] + "Z")
            assert (now - renewed).total_seconds() < NODE_LEASE_SECONDS, lease
    not_ready = [e for e in cluster.get("events", namespace="default")["items"]
                 if e["reason"] == "NodeNotReady" and e["involvedObject"].get("name") in names]
    assert not_ready == []
