"""`rollout.nodesPerServer` > 1 against the real LeaderWorkerSet controller v0.9.0 (built by
tests/cluster/lws/build.sh, skipped until then) with its CRD and its admission webhooks (the pod
webhook gives a group's pods their LWS labels and LWS_* variables), and kwok GPU pods.

Checked: the operator's LeaderWorkerSet is admitted and the controller makes a leader and a
worker per group, with the GPUs split, the vLLM multi-node flags and LWS's variables that
Kubernetes expands into them; the rollout Service's endpoints are the leaders only, which the
trainer's endpoints name; the job goes Running counting each group as one server; a worker
whose container restarts makes the LWS controller recreate its group (leader and worker
replaced, the other group untouched) while the job keeps running, no restart spent; a failed
trainer restarts the whole job, the LeaderWorkerSet of the next attempt with it.
"""

from __future__ import annotations

import json

import pytest

from . import lws_controller
from .harness import Cluster, wait_for
from .test_operator import GPU, create, job_doc, operator_in_namespace, pods, wait_job

pytestmark = pytest.mark.cluster
INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP = "leaderworkerset.sigs.k8s.io/group-index"


@pytest.fixture(scope="module")
def lws(cluster: Cluster, tmp_path_factory):
    bin_dir = lws_controller.built()
    if bin_dir is None:
        pytest.skip("the LeaderWorkerSet controller is not built: `make lws-bin` (a few minutes, once)")
    with lws_controller.lws_controller(cluster, bin_dir, tmp_path_factory.mktemp("lws")) as log:
        yield {"log": log}


@pytest.fixture(scope="module")
def setup(cluster: Cluster, lws, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "lws") as s:
        yield s


def lws_doc(name: str, **spec) -> dict:
    doc = job_doc(name, **spec)
    doc["spec"]["rollout"].update(replicas=2, tensorParallelSize=4, nodesPerServer=2)
    return doc


def group_pods(cluster: Cluster, ns: str, name: str, attempt: int) -> dict[str, dict]:
    """The 4 rollout pods and the trainer of `attempt`, all Running, by name."""
    def ready():
        ps = [p for p in pods(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]
        ok = len(ps) == 5 and all(p["metadata"]["labels"].get("rlhf.dev/attempt") == str(attempt)
                                  and p["status"].get("phase") == "Running" for p in ps)
        return {p["metadata"]["name"]: p for p in ps} if ok else None
    return wait_for(ready, 90, f"5 pods of attempt {attempt} Running")


def test_a_group_per_server_run_by_the_lws_controller_and_recreated_alone(cluster: Cluster, setup, lws):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, lws_doc("mn"))
    j = wait_job(cluster, ns, "mn", "Running", 0, log=log, timeout=120)
    assert "2/2 rollout, 1/1 trainer" in j["status"]["message"]  # groups counted as servers
    lws_obj = cluster.get("leaderworkerset", "mn-rollout", namespace=ns)
    assert lws_obj["metadata"]["ownerReferences"][0]["uid"] == j["metadata"]["uid"]
    wait_for(lambda: (cluster.get("leaderworkerset", "mn-rollout", namespace=ns).get("status") or {})
             .get("readyReplicas") == 2, 60, "the LeaderWorkerSet's 2 groups ready")

    ps = group_pods(cluster, ns, "mn", 0)
    rollout = {n: p for n, p in ps.items() if p["metadata"]["labels"]["rlhf.dev/role"] == "rollout"}
    assert sorted(rollout) == ["mn-rollout-0", "mn-rollout-0-1", "mn-rollout-1", "mn-rollout-1-1"]  # LWS's names
    for p in rollout.values():
        (c,) = p["spec"]["containers"]
        assert c["resources"]["limits"][GPU] == "2"  # tensorParallelSize 4 over 2 nodes
        env = {e["name"]: e.get("value") for e in c["env"]}
        group, index = p["metadata"]["labels"][GROUP], p["metadata"]["labels"][INDEX]
        assert (env["LWS_GROUP_SIZE"], env["LWS_WORKER_INDEX"]) == ("2", index)  # set by LWS's pod webhook
        assert env["LWS_LEADER_ADDRESS"] == f"mn-rollout-{group}.mn-rollout.{ns}"
        assert ("--headless" in c["command"]) is (index != "0")
        assert c["command"][c["command"].index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"  # Kubernetes expands it
    # the Service: the leaders only (their DNS names are the trainer's endpoints)
    eps = cluster.get("endpointslices", namespace=ns, selector="kubernetes.io/service-name=mn-rollout")["items"]
    assert sorted(e["targetRef"]["name"] for s in eps for e in s.get("endpoints") or []) == [
        "mn-rollout-0", "mn-rollout-1"]
    trainer = next(p for p in ps.values() if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer")
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    assert env["RLHF_ROLLOUT_ENDPOINTS"] == (f"http://mn-rollout-0.mn-rollout.{ns}.svc:8000,"
                                             f"http://mn-rollout-1.mn-rollout.{ns}.svc:8000")

    # A worker's container restarts (vLLM's headless node crashed): LWS recreates its group.
    before = {n: p["metadata"]["uid"] for n, p in ps.items()}
    status = {"status": {"containerStatuses": [{
        "name": "server", "restartCount": 1, "ready": True, "image": "example.invalid/vllm:1", "imageID": "",
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": "2026-01-01T00:00:00Z",
                                     "finishedAt": "2026-01-01T00:00:01Z"}}}]}}
    cluster.kubectl("patch", "pod", "mn-rollout-1-1", "-n", ns, "--subresource=status", "--type=strategic",
                    "-p", json.dumps(status))

    def recreated():
        now = group_pods(cluster, ns, "mn", 0)
        return now if all(now[n]["metadata"]["uid"] != before[n] for n in ("mn-rollout-1", "mn-rollout-1-1")) else None
    after = wait_for(recreated, 90, "group 1 recreated by the LWS controller")
    assert all(after[n]["metadata"]["uid"] == before[n] for n in ("mn-rollout-0", "mn-rollout-0-1", "mn-trainer-master-0"))
    j = wait_job(cluster, ns, "mn", "Running", 0, log=log)
    assert j["status"]["restarts"] == 0 and "2/2 rollout" in j["status"]["message"]

    # The trainer failing restarts the whole job: a new LeaderWorkerSet for attempt 1.
    cluster.fail_pod(ns, "mn-trainer-master-0", exit_code=1)
    wait_job(cluster, ns, "mn", "Running", 1, log=log, timeout=120)
    assert cluster.get("leaderworkerset", "mn-rollout", namespace=ns)["metadata"]["labels"]["rlhf.dev/attempt"] == "1"
    group_pods(cluster, ns, "mn", 1)
