"""`rollout.nodesPerServer` > 1: the rollout servers' LeaderWorkerSet (builders/lws.py), the
Service selecting its leaders, the rules, and the status read from its groups (lws_status.py).

The manifest is also created on the real API server with the LWS controller's own CRD, webhooks
and controller (tests/cluster/test_lws.py); vLLM's parser checks the flags (tests/protocol)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from helpers import fake_pod, job_of
from rlhf_contract.backends import missing_message
from rlhf_contract.exit_codes import PERMANENT
from rlhf_operator.backends import build_children, job_settings
from rlhf_operator.builders import PodSettingsError
from rlhf_operator.status import Observed, plan

UID = "uid-lws"
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
LWS_LABELS = ("leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/group-index",
              "leaderworkerset.sigs.k8s.io/worker-index")


def body(status=None, *, tp=8, nodes=2, replicas=2, nproc=1, **rollout):
    return {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "demo", "namespace": "ns", "uid": UID, "generation": 1,
                     "creationTimestamp": (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")},
        "spec": {"model": {"path": "/m"}, "data": {"path": "/d"}, "trainer": {"numNodes": 1, "nprocPerNode": nproc},
                 "rollout": {"replicas": replicas, "tensorParallelSize": tp, "nodesPerServer": nodes, **rollout},
                 "runPolicy": {"maxRestarts": 2},
                 "pod": {"volumes": [{"name": "w", "emptyDir": {}}],
                         "volumeMounts": [{"name": "w", "mountPath": p, "subPath": p.strip("/")}
                                          for p in ("/m", "/d", "/output")]}},
        **({"status": status} if status else {}),
    }


def children(b):
    return {c["kind"] + "/" + c["metadata"]["name"]: c for c in build_children(job_of(b), 0)}


def test_a_multi_node_server_is_a_leaderworkerset_group_with_the_gpus_split_over_its_pods():
    kids = children(body())
    assert "StatefulSet/demo-rollout" not in kids
    lws = kids["LeaderWorkerSet/demo-rollout"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["labels"]["rlhf.dev/attempt"] == "0"
    spec = lws["spec"]
    assert spec["replicas"] == 2 and spec["startupPolicy"] == "LeaderCreated"
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    for part in ("leaderTemplate", "workerTemplate"):
        (c,) = lwt[part]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"  # tensorParallelSize 8 over 2 pods
        labels = lwt[part]["metadata"]["labels"]
        assert labels["rlhf.dev/role"] == "rollout" and labels["rlhf.dev/job-uid"] == UID
        assert _flag(c["command"], "--tensor-parallel-size") == "8"  # the whole group's


def _flag(command, name):
    return command[command.index(name) + 1]


def test_the_leader_serves_http_and_the_workers_are_headless_ranks_of_lws_env():
    lwt = children(body())["LeaderWorkerSet/demo-rollout"]["spec"]["leaderWorkerTemplate"]
    (leader,) = lwt["leaderTemplate"]["spec"]["containers"]
    (worker,) = lwt["workerTemplate"]["spec"]["containers"]
    assert "--headless" not in leader["command"] and worker["command"][-1] == "--headless"
    assert _flag(leader["command"], "--node-rank") == "0"
    assert _flag(worker["command"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    for c in (leader, worker):  # Kubernetes expands these from the env LWS sets in every container
        assert _flag(c["command"], "--nnodes") == "$(LWS_GROUP_SIZE)"
        assert _flag(c["command"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert _flag(c["command"], "--master-port") == "29501"
    assert {p["name"] for p in leader["ports"]} == {"http", "vllm-master"}
    assert leader["readinessProbe"]["httpGet"]["path"] == "/health"
    assert not any(k in worker for k in ("ports", "readinessProbe", "livenessProbe", "startupProbe"))


def test_the_rollout_service_selects_the_leaders_only_and_the_endpoints_are_theirs():
    kids = children(body())
    svc = kids["Service/demo-rollout"]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert svc["spec"]["clusterIP"] == "None"
    one_node = children(body(tp=8, nodes=1))["Service/demo-rollout"]
    assert "leaderworkerset.sigs.k8s.io/worker-index" not in one_node["spec"]["selector"]
    # the trainer's servers: the leaders, `<lws>-<group>` in the Service's subdomain (as the StatefulSet's)
    env = {e["name"]: e.get("value") for e in kids["PyTorchJob/demo-trainer"]["spec"]["pytorchReplicaSpecs"]
           ["Master"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLHF_ROLLOUT_ENDPOINTS"].split(",") == [
        "http://demo-rollout-0.demo-rollout.ns.svc:8000", "http://demo-rollout-1.demo-rollout.ns.svc:8000"]


def test_one_node_servers_stay_a_statefulset():
    kids = children(body(tp=8, nodes=1))
    assert "StatefulSet/demo-rollout" in kids and not any(k.startswith("LeaderWorkerSet") for k in kids)


@pytest.mark.parametrize("change,match", [
    ({"tp": 6, "nodes": 4}, r"rollout.nodesPerServer: must divide rollout.tensorParallelSize: .*\(got 4 for "
                            r"tensorParallelSize 6\)"),
    ({"engine": "cpu"}, r"rollout.nodesPerServer: above 1 needs rollout.engine vllm"),
    ({"placement": "colocated", "vllm": {"kvCacheMemoryBytes": 2**30}, "replicas": 1, "tp": 2, "nproc": 2},
     r"rollout.nodesPerServer: above 1 needs.*got engine vllm, placement colocated"),
])
def test_rules_refuse_what_a_group_cannot_be_naming_the_field(change, match):
    b = body(**change)
    with pytest.raises(PodSettingsError, match=match):  # cluster rules: the operator's builders and the CRD's CEL
        job_settings(job_of(b))


def test_a_jobset_backend_is_refused_for_multi_node_servers():
    b = body()
    b["spec"]["backend"] = "JobSet"
    with pytest.raises(PodSettingsError, match="spec.backend PyTorchJob or TrainJob"):
        job_settings(job_of(b))


def test_a_missing_lws_crd_names_what_to_install_and_the_way_out():
    msg = missing_message("LeaderWorkerSet")
    assert "leaderworkersets.leaderworkerset.x-k8s.io" in msg and "kubernetes-sigs/lws" in msg
    assert "rollout.nodesPerServer: 1" in msg


# ---- status: a group is one server

def lws_pod(group, index, attempt=0, **kw):
    name = f"demo-rollout-{group}" + (f"-{index}" if index else "")
    labels = {"rlhf.dev/role": "rollout", "rlhf.dev/attempt": str(attempt), "rlhf.dev/job-uid": UID,
              LWS_LABELS[0]: "demo-rollout", LWS_LABELS[1]: str(group), LWS_LABELS[2]: str(index)}
    return fake_pod(name, labels, **kw)


def workload(kind, attempt=0):
    return {"kind": kind, "metadata": {"name": "x", "labels": {"rlhf.dev/attempt": str(attempt)},
                                       "ownerReferences": [{"uid": UID, "controller": True}]}, "status": {}}


def trainer(**kw):
    return fake_pod("demo-trainer-master-0", {"rlhf.dev/role": "trainer", "rlhf.dev/attempt": "0",
                                              "rlhf.dev/job-uid": UID}, **kw)


def observed(pods):
    return Observed(leaderworkerset=workload("LeaderWorkerSet"), pytorchjob=workload("PyTorchJob"), pods=pods)


def run(pods, phase="Running"):
    b = body({"phase": phase})
    return plan(b, job_of(b), observed(pods), NOW)


def test_running_counts_groups_as_servers():
    pods = [lws_pod(g, i) for g in range(2) for i in range(2)] + [trainer()]
    p = run(pods, phase="Pending")
    assert p.status["phase"] == "Running" and "2/2 rollout, 1/1 trainer" in p.status["message"]
    # a group without its worker is no server yet
    p = run(pods[:3] + [trainer()], phase="Pending")
    assert p.status["phase"] == "Pending" and "1/2 rollout" in p.status["message"]
    # a worker not running: the group is not running
    p = run([lws_pod(0, 0), lws_pod(0, 1, phase="Pending"), lws_pod(1, 0), lws_pod(1, 1), trainer()], "Pending")
    assert p.status["phase"] == "Initializing" and "1/2 rollout" in p.status["message"]
    # without its LeaderWorkerSet the job is still creating it
    b = body({"phase": "Pending"})
    p = plan(b, job_of(b), Observed(pytorchjob=workload("PyTorchJob"), pods=pods), NOW)
    assert p.status["phase"] == "Pending" and p.create_workloads


def test_a_failed_worker_is_left_to_lws_but_a_permanent_exit_fails_the_job():
    pods = [lws_pod(0, 0), lws_pod(0, 1, restarts=1), lws_pod(1, 0), lws_pod(1, 1), trainer()]
    p = run(pods)
    assert p.status["phase"] != "Restarting" and p.status["restarts"] == 0 and p.delete == []
    code = next(iter(PERMANENT))
    p = run([lws_pod(0, 0), lws_pod(0, 1, exit_code=code), lws_pod(1, 0), lws_pod(1, 1), trainer()])
    assert p.status["phase"] == "Failed" and "demo-rollout-0-1" in p.status["message"]
    assert "LeaderWorkerSet" in p.delete
    # a failed trainer still restarts everything, the LeaderWorkerSet with it
    p = run([lws_pod(g, i) for g in range(2) for i in range(2)] + [trainer(exit_code=1)])
    assert p.status["phase"] == "Restarting" and set(p.delete) == {"LeaderWorkerSet", "PyTorchJob"}


def test_a_finished_job_deletes_its_leaderworkerset():
    b = body({"phase": "Running"})
    obs = observed([lws_pod(0, 0), lws_pod(0, 1), trainer(phase="Succeeded")])
    obs.pytorchjob["status"] = {"conditions": [{"type": "Succeeded", "status": "True"}]}
    p = plan(b, job_of(b), obs, NOW)
    assert p.status["phase"] == "Succeeded" and p.delete == ["LeaderWorkerSet"]
