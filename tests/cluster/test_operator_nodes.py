"""The operator when nodes and pods misbehave as on a real cluster: a lost node (its kubelet
gone, its pods stuck Terminating) leads to one whole-job restart that completes; a rollout
server dying as the trainer finishes leaves the job Succeeded. Its own operator process,
with a 5 s lost-node grace period (60 s by default)."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from .harness import Cluster, wait_for
from .test_operator import by_role, condition, create, events, job, job_doc, operator_in_namespace, pods, \
    running_pods, wait_job

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "nodes", env={"RLHF_OPERATOR_NODE_LOST_SECONDS": "5"}) as s:
        yield s


def test_lost_node_with_the_trainer_restarts_the_job_once_and_the_restart_completes(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    group = f"lossy{uuid.uuid4().hex[:4]}"
    cluster.start_kwok(group)
    (lossy,) = cluster.create_nodes(1, prefix=f"{group}-node", group=group)
    cluster.wait_nodes_ready([lossy], timeout=30)
    others = [n["metadata"]["name"] for n in cluster.get("nodes")["items"] if n["metadata"]["name"] != lossy]
    try:
        # Every pod of attempt 0 on the node that will be lost.
        for n in others:
            cluster.kubectl("cordon", n)
        try:
            create(cluster, ns, job_doc("lost"))
            wait_job(cluster, ns, "lost", "Running", 0, log=log)
            ps = running_pods(cluster, ns, "lost", 0)
            assert {p["spec"]["nodeName"] for p in ps} == {lossy}
        finally:
            for n in others:
                cluster.kubectl("uncordon", n)

        lost = cluster.lose_nodes(group)
        assert lost == [lossy]
        cluster.kubectl("cordon", lossy)  # as an autoscaler or an admin would; new pods go elsewhere
        # One restart, which completes although the old pods' kubelet never confirms their deletion.
        wait_job(cluster, ns, "lost", "Running", 1, timeout=120, log=log)
        ps = running_pods(cluster, ns, "lost", 1)
        assert lossy not in {p["spec"]["nodeName"] for p in ps}
        j = job(cluster, ns, "lost")
        restarting = condition(j, "Restarting")
        assert "NodeLost" in restarting["message"] and f"node {lossy} not Ready" in restarting["message"]
        assert "force-deleting pod" in log.read_text()
        assert events(cluster, ns, "lost").count("Disrupted") == 1  # a lost node spends no restart (status.disruptions)
        assert "PodFailed" not in events(cluster, ns, "lost")
        assert not [p for p in pods(cluster, ns, "lost") if p["spec"].get("nodeName") == lossy]
        cluster.kubectl("delete", "rlhfjob", "lost", "-n", ns, "--wait=false")
    finally:
        cluster.kubectl("delete", "node", lossy, "--wait=false", check=False)


def rollout_failed(cluster: Cluster, ns: str, name: str, uid: str) -> bool:
    """The server's container terminated, or the StatefulSet controller already replaced
    the failed pod (a new uid under the same name)."""
    proc = cluster.kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    if proc.returncode != 0:
        return True
    pod = json.loads(proc.stdout)
    if pod["metadata"]["uid"] != uid or pod["status"].get("phase") == "Failed":
        return True
    return any(cs.get("restartCount", 0) > 0 or "terminated" in (cs.get("state") or {})
               or "terminated" in (cs.get("lastState") or {}) for cs in pod["status"].get("containerStatuses", []))


def test_rollout_failure_after_the_trainer_succeeded_leaves_the_job_succeeded(cluster: Cluster, setup):
    ns, log, proc = setup["ns"], setup["log"], setup["proc"]
    create(cluster, ns, job_doc("fin"))
    wait_job(cluster, ns, "fin", "Running", 0, log=log)
    ps = running_pods(cluster, ns, "fin", 0)
    master, server = by_role(ps, "trainer")[0]["metadata"]["name"], by_role(ps, "rollout")[0]["metadata"]
    rollout = server["name"]
    # Both happen while the operator is paused, so that it sees them in one reconcile.
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        cluster.complete_pod(ns, master)
        wait_for(lambda: any(c["type"] == "Succeeded" and c["status"] == "True" for c in
                             cluster.get("pytorchjob", "fin-trainer", namespace=ns)["status"].get("conditions", [])),
                 30, "the PyTorchJob Succeeded")
        cluster.fail_pod(ns, rollout, exit_code=1)
        wait_for(lambda: rollout_failed(cluster, ns, rollout, server["uid"]), 30, "the rollout server's container failed")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    j = wait_job(cluster, ns, "fin", "Succeeded", 0, log=log)
    assert condition(j, "Succeeded")["reason"] == "TrainerSucceeded"
    time.sleep(6)  # three resyncs: still Succeeded, never restarted
    j = job(cluster, ns, "fin")
    assert j["status"]["phase"] == "Succeeded" and j["status"]["restarts"] == 0
    assert "PodFailed" not in events(cluster, ns, "fin")
    wait_for(lambda: not cluster.kubectl("get", "statefulset", "-n", ns, "-l", "rlhf.dev/job=fin", "-o",
                                         "name").stdout.strip(), 30, "rollout servers stopped")
    cluster.kubectl("delete", "rlhfjob", "fin", "-n", ns, "--wait=false")
