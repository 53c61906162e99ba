"""`spec.backend: TrainJob` against the real Kubeflow Trainer v2.3 controller (built by
tests/cluster/trainer/build.sh, skipped until then) with its CRDs and admission webhooks,
the chart's ClusterTrainingRuntime `rlhf-torch`, the JobSet controller it builds on, and
kwok pods in a `restricted` namespace.

Checked: the TrainJob is admitted by Trainer's webhooks and becomes a JobSet whose pods carry
the job's labels, the user's labels and annotations from birth (the runtime patch); torchrun's PET_* variables are Trainer's and
name the pods' real DNS names; the weight-sync Service selects rank 0; any failed pod
restarts the whole job (a new TrainJob, new pods, attempt + 1); a permanent exit code fails
at once; suspend deletes every pod and resume brings the job back; the trainer finishing is
Succeeded (the TrainJob Complete); a lost node restarts the job once, spending no restart.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import yaml

from . import trainer_v2
from .harness import Cluster, wait_for
from .test_monitoring import CHART, selector_of, within
from .test_operator import condition, create, job, job_doc, operator_in_namespace, pods, wait_job

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def trainer(cluster: Cluster, tmp_path_factory):
    bin_dir = trainer_v2.built()
    if bin_dir is None:
        pytest.skip("Kubeflow Trainer v2 is not built: `make trainer-bin` (about a minute, once)")
    with trainer_v2.trainer_controller(cluster, bin_dir, tmp_path_factory.mktemp("trainer")) as log:
        yield {"log": log}


@pytest.fixture(scope="module")
def setup(cluster: Cluster, trainer, tmp_path_factory):
    # a 5 s lost-node grace (60 s by default), as test_operator_nodes.py
    with operator_in_namespace(cluster, tmp_path_factory, "tj", env={"RLHF_OPERATOR_NODE_LOST_SECONDS": "5"}) as s:
        yield s


def trainjob_doc(name: str, nodes: int = 2, **spec) -> dict:
    """test_operator's job with backend TrainJob; one volume mounted once (a TrainJob lists
    a container's mounts by volume name)."""
    doc = job_doc(name, nodes=nodes, backend="TrainJob", model={"path": "/work/models/tiny"},
                  data={"path": "/work/data/train.jsonl"}, output={"dir": "/work/output"}, **spec)
    doc["spec"]["pod"]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    return doc


def attempt_pods(cluster: Cluster, ns: str, name: str, attempt: int, count: int) -> list[dict]:
    """`count` Running pods of `attempt` (the trainer's adopted by the operator), and no other."""
    def ready():
        ps = [p for p in pods(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]
        ok = len(ps) == count and all(p["metadata"]["labels"].get("rlhf.dev/attempt") == str(attempt)
                                      and p["status"].get("phase") == "Running" for p in ps)
        return ps if ok else None
    return wait_for(ready, 90, f"{count} pods of attempt {attempt} Running")


def test_trainjob_runs_restarts_as_one_unit_and_fails_on_a_permanent_code(cluster: Cluster, setup, tmp_path):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, trainjob_doc("tjr", runPolicy={"maxRestarts": 3}))
    wait_job(cluster, ns, "tjr", "Running", 0, log=log, timeout=120)
    tj = cluster.get("trainjob", "tjr-trainer", namespace=ns)
    assert tj["spec"]["runtimeRef"]["name"] == "rlhf-torch" and tj["metadata"]["labels"]["rlhf.dev/attempt"] == "0"
    js = cluster.get("jobset", "tjr-trainer", namespace=ns)  # made by Trainer v2, owned by the TrainJob
    assert js["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
    ps = attempt_pods(cluster, ns, "tjr", 0, count=4)
    trainers = sorted((p for p in ps if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer"),
                      key=lambda p: p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])
    assert len(trainers) == 2
    env = {e["name"]: e.get("value") for e in trainers[0]["spec"]["containers"][0]["env"]}
    dns = f"{trainers[0]['spec']['hostname']}.{trainers[0]['spec']['subdomain']}"
    assert env["PET_MASTER_ADDR"] == dns == "tjr-trainer-node-0-0.tjr-trainer"  # Trainer's torch plugin
    assert (env["PET_NNODES"], env["PET_NPROC_PER_NODE"], env["PET_MASTER_PORT"]) == ("2", "2", "29500")
    assert env["RLHF_TRAINER_CONFIG"] == "/etc/rlhf/trainer.json"  # ours, through trainer.env
    eps = cluster.get("endpointslices", namespace=ns, selector="kubernetes.io/service-name=tjr-weight-sync")["items"]
    assert [e["targetRef"]["name"] for s in eps for e in s.get("endpoints") or []] == [trainers[0]["metadata"]["name"]]
    # The chart's trainer PodMonitor selects them (the runtime's labels), and `rlhfctl render`
    # prints what the operator created: every rendered field is in the live object.
    monitor = yaml.safe_load(cluster.helm("template", "rel", str(CHART), "--kube-version", "1.34.0", "--show-only",
                                          "templates/trainer-podmonitor.yaml",
                                          "--set", "trainerMetrics.podMonitor.enabled=true").stdout)
    assert {p["metadata"]["name"] for p in cluster.get("pods", namespace=ns, selector=selector_of(
        monitor["spec"]["selector"]))["items"]} >= {p["metadata"]["name"] for p in trainers}
    path = tmp_path / "tjr.yaml"
    path.write_text(yaml.safe_dump(trainjob_doc("tjr", runPolicy={"maxRestarts": 3})))
    out = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "render", str(path), "--namespace", ns, "--uid",
                          job(cluster, ns, "tjr")["metadata"]["uid"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = {d["kind"]: d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] in ("TrainJob", "StatefulSet")}
    assert within(rendered["TrainJob"], cluster.get("trainjob", "tjr-trainer", namespace=ns))
    assert within(rendered["StatefulSet"], cluster.get("statefulset", "tjr-rollout", namespace=ns))

    # A trainer pod fails: the whole job restarts (new TrainJob and servers, attempt 1).
    old = {p["metadata"]["uid"] for p in ps}
    cluster.fail_pod(ns, trainers[1]["metadata"]["name"], exit_code=1)
    wait_job(cluster, ns, "tjr", "Running", 1, log=log, timeout=120)
    ps = attempt_pods(cluster, ns, "tjr", 1, count=4)
    assert not old & {p["metadata"]["uid"] for p in ps}
    assert trainers[1]["metadata"]["name"] in condition(job(cluster, ns, "tjr"), "Restarting")["message"]

    # A permanent exit code (2: bad config) fails at once, budget left or not.
    victim = next(p for p in ps if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer")["metadata"]["name"]
    cluster.fail_pod(ns, victim, exit_code=2, message="bad config")
    j = wait_job(cluster, ns, "tjr", "Failed", 1, log=log)
    assert condition(j, "Failed")["reason"] == "PermanentError" and victim in condition(j, "Failed")["message"]
    cluster.kubectl("delete", "rlhfjob", "tjr", "-n", ns, "--wait=false")


def test_trainjob_suspend_resume_and_succeed(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, trainjob_doc("tjs", nodes=1))
    wait_job(cluster, ns, "tjs", "Running", 0, log=log, timeout=120)
    cluster.kubectl("patch", "rlhfjob", "tjs", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_job(cluster, ns, "tjs", "Suspended", 0, log=log)
    wait_for(lambda: not pods(cluster, ns, "tjs"), 60, "pods deleted while suspended")
    cluster.kubectl("patch", "rlhfjob", "tjs", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    j = wait_job(cluster, ns, "tjs", "Running", 0, log=log, timeout=120)
    assert condition(j, "Suspended")["reason"] == "Resumed"
    ps = attempt_pods(cluster, ns, "tjs", 0, count=3)
    # The trainer finishes: the TrainJob is Complete, the job Succeeded, the servers go.
    cluster.complete_pod(ns, next(p for p in ps if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer")
                         ["metadata"]["name"])
    wait_job(cluster, ns, "tjs", "Succeeded", 0, log=log)
    tj = cluster.get("trainjob", "tjs-trainer", namespace=ns)
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in tj["status"]["conditions"])
    wait_for(lambda: cluster.kubectl("get", "statefulset", "tjs-rollout", "-n", ns, check=False).returncode != 0,
             60, "the rollout servers deleted")
    cluster.kubectl("delete", "rlhfjob", "tjs", "-n", ns, "--wait=false")


def test_trainjob_lost_node_restarts_the_job_once_without_spending_a_restart(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    group = f"tjlost{uuid.uuid4().hex[:4]}"
    cluster.start_kwok(group)
    (lossy,) = cluster.create_nodes(1, prefix=f"{group}-node", group=group)
    cluster.wait_nodes_ready([lossy], timeout=30)
    others = [n["metadata"]["name"] for n in cluster.get("nodes")["items"] if n["metadata"]["name"] != lossy]
    try:
        for n in others:  # every pod of attempt 0 on the node that will be lost
            cluster.kubectl("cordon", n)
        try:
            create(cluster, ns, trainjob_doc("tjl", nodes=1))
            wait_job(cluster, ns, "tjl", "Running", 0, log=log, timeout=120)
            assert {p["spec"]["nodeName"] for p in attempt_pods(cluster, ns, "tjl", 0, count=3)} == {lossy}
        finally:
            for n in others:
                cluster.kubectl("uncordon", n)
        assert cluster.lose_nodes(group) == [lossy]
        cluster.kubectl("cordon", lossy)
        wait_job(cluster, ns, "tjl", "Running", 1, timeout=120, log=log)
        ps = attempt_pods(cluster, ns, "tjl", 1, count=3)
        assert lossy not in {p["spec"]["nodeName"] for p in ps}
        j = job(cluster, ns, "tjl")
        assert "NodeLost" in condition(j, "Restarting")["message"] and j["status"].get("disruptions") == 1
        cluster.kubectl("delete", "rlhfjob", "tjl", "-n", ns, "--wait=false")
    finally:
        cluster.kubectl("delete", "node", lossy, "--wait=false", check=False)


def test_what_v2_0_could_not_carry_reaches_the_pods_through_the_runtime_patch(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    doc = trainjob_doc("tjp", nodes=1)
    doc["spec"]["trainer"]["pod"] = {"labels": {"team": "rl"}, "annotations": {"example.com/note": "v2.3"},
                                     "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                                         {"weight": 1, "preference": {"matchExpressions": [
                                             {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}}]}}}
    create(cluster, ns, doc)
    wait_job(cluster, ns, "tjp", "Running", 0, log=log, timeout=120)
    tj = cluster.get("trainjob", "tjp-trainer", namespace=ns)
    (patch,) = tj["spec"]["runtimePatches"]
    assert patch["manager"] == "rlhf.dev/operator" and patch.get("time")  # Trainer's defaulting webhook ran
    trainer = next(p for p in attempt_pods(cluster, ns, "tjp", 0, count=3)
                   if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer")
    labels = trainer["metadata"]["labels"]
    assert labels["team"] == "rl" and labels["rlhf.dev/job-uid"] == job(cluster, ns, "tjp")["metadata"]["uid"]
    assert trainer["metadata"]["annotations"]["example.com/note"] == "v2.3"
    assert trainer["spec"]["affinity"] == doc["spec"]["trainer"]["pod"]["affinity"]
    assert trainer["spec"]["serviceAccountName"] == "tjp-trainer"
    cluster.kubectl("delete", "rlhfjob", "tjp", "-n", ns, "--wait=false")


def test_what_a_v2_3_trainjob_cannot_carry_fails_the_job_at_once(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    doc = trainjob_doc("tjx", nodes=1)
    doc["spec"]["pod"]["priorityClassName"] = "high"
    create(cluster, ns, doc)
    j = wait_job(cluster, ns, "tjx", "Failed", 0, log=log, timeout=30)
    assert condition(j, "Failed")["reason"] == "InvalidSpec"
    assert "spec.pod.priorityClassName" in condition(j, "Failed")["message"]
    assert cluster.kubectl("get", "trainjob", "tjx-trainer", "-n", ns, check=False).returncode != 0
    cluster.kubectl("delete", "rlhfjob", "tjx", "-n", ns, "--wait=false")
