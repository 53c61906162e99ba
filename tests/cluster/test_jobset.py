"""`spec.backend: JobSet` against the real control plane: the JobSet controller v0.12 with
its CRD and admission webhooks (built from its Go module like the other tools), the
kube-controller-manager's Job controller, kwok pods.

Checked on the objects: one JobSet holds the trainer and the rollout servers and carries
the Kueue queue label (so Kueue admits the whole job as one workload); the addresses the
trainer is given are the pods' real DNS names; any pod failing restarts every pod (JobSet's
failure policy); the budget ends in Failed; a permanent exit code fails at once; the
trainer finishing is Succeeded and stops the servers; the budget cannot change on such a job.
"""

from __future__ import annotations

import json

import pytest

from .harness import Cluster, wait_for
from .test_operator import condition, create, events, job, job_doc, operator_in_namespace, pods, wait_job

pytestmark = pytest.mark.cluster

QUEUE = "kueue.x-k8s.io/queue-name"
ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "js") as s:
        yield s


def jobset_doc(name: str, max_restarts: int = 1, queue: str | None = None, nodes: int = 2) -> dict:
    doc = job_doc(name, nodes=nodes, backend="JobSet", runPolicy={"maxRestarts": max_restarts})
    if queue:
        doc["metadata"]["labels"] = {QUEUE: queue}
    return doc


def attempt_pods(cluster: Cluster, ns: str, name: str, attempt: int, count: int = 4) -> list[dict]:
    """`count` pods of JobSet restart attempt `attempt`, all Running (and no other pod)."""
    def ready():
        ps = [p for p in pods(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]
        if len(ps) == count and all(p["metadata"]["labels"].get(ATTEMPT) == str(attempt)
                                    and p["status"].get("phase") == "Running" for p in ps):
            return ps
        return None
    return wait_for(ready, 90, f"{count} pods of restart attempt {attempt} Running")


def role(ps: list[dict], r: str) -> list[dict]:
    return sorted((p for p in ps if p["metadata"]["labels"]["rlhf.dev/role"] == r),
                  key=lambda p: p["metadata"]["name"])


def env_of(p: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}


def test_jobset_runs_restarts_as_one_unit_and_spends_its_budget(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, jobset_doc("jsr", max_restarts=1, queue="team-a"))
    wait_job(cluster, ns, "jsr", "Running", 0, log=log)

    # One JobSet, carrying the queue label; no StatefulSet, no PyTorchJob.
    kinds = cluster.kubectl("get", "statefulset,pytorchjob,jobset", "-n", ns, "-l", "rlhf.dev/job=jsr",
                            "-o", "name").stdout.split()
    assert kinds == ["jobset.jobset.x-k8s.io/jsr"]
    js = cluster.get("jobset", "jsr", namespace=ns)
    assert js["metadata"]["labels"][QUEUE] == "team-a"
    assert {r["name"] for r in js["spec"]["replicatedJobs"]} == {"trainer", "rollout"}

    ps = attempt_pods(cluster, ns, "jsr", 0)
    trainers, servers = role(ps, "trainer"), role(ps, "rollout")
    assert len(trainers) == 2 and len(servers) == 2

    # The addresses the trainer is given are the pods' own DNS names (hostname.subdomain).
    def dns(p: dict) -> str:
        return f"{p['spec']['hostname']}.{p['spec']['subdomain']}.{ns}.svc"
    env = env_of(trainers[0])
    assert sorted(env["RLHF_ROLLOUT_ENDPOINTS"].split(",")) == sorted(f"http://{dns(p)}:8000" for p in servers)
    rank0 = next(p for p in trainers if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0")
    assert env["PET_MASTER_ADDR"] == dns(rank0) and env["PET_NNODES"] == "2"
    svc = cluster.get("service", rank0["spec"]["subdomain"], namespace=ns)  # made by JobSet, headless
    assert svc["spec"]["clusterIP"] == "None"
    # The weight-sync Service selects exactly trainer rank 0.
    eps = cluster.get("endpointslices", namespace=ns, selector="kubernetes.io/service-name=jsr-weight-sync")["items"]
    assert [e["targetRef"]["name"] for s in eps for e in s.get("endpoints") or []] == [rank0["metadata"]["name"]]

    # A rollout server fails: every pod is replaced (attempt 1), the job restarts once.
    old = {p["metadata"]["uid"] for p in ps}
    cluster.fail_pod(ns, servers[1]["metadata"]["name"], exit_code=1)
    wait_job(cluster, ns, "jsr", "Running", 1, log=log)
    ps = attempt_pods(cluster, ns, "jsr", 1)
    assert not old & {p["metadata"]["uid"] for p in ps}
    j = job(cluster, ns, "jsr")
    assert servers[1]["metadata"]["name"] in condition(j, "Restarting")["message"]
    assert cluster.get("jobset", "jsr", namespace=ns)["status"]["restarts"] == 1

    # The budget (1) is spent: the next failure ends in Failed, naming the pod and its code.
    victim = role(ps, "trainer")[1]["metadata"]["name"]
    cluster.fail_pod(ns, victim, exit_code=137, reason="OOMKilled")
    j = wait_job(cluster, ns, "jsr", "Failed", 1, log=log)
    failed = condition(j, "Failed")
    assert failed["reason"] == "RestartLimitExceeded" and victim in failed["message"] and "137" in failed["message"]
    assert events(cluster, ns, "jsr").count("PodFailed") == 1
    wait_for(lambda: not [p for p in pods(cluster, ns, "jsr") if p["status"].get("phase") == "Running"], 60,
             "no pod of the failed job running")
    cluster.kubectl("delete", "rlhfjob", "jsr", "-n", ns, "--wait=false")


def test_jobset_permanent_exit_code_fails_at_once(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, jobset_doc("jsp", max_restarts=5, nodes=1))
    wait_job(cluster, ns, "jsp", "Running", 0, log=log)
    ps = attempt_pods(cluster, ns, "jsp", 0, count=3)
    cluster.fail_pod(ns, role(ps, "trainer")[0]["metadata"]["name"], exit_code=2, message="bad config")
    j = wait_job(cluster, ns, "jsp", "Failed", 0, log=log)
    assert condition(j, "Failed")["reason"] == "PermanentError"
    assert "exited with code 2" in condition(j, "Failed")["message"]
    assert cluster.get("jobset", "jsp", namespace=ns)["status"]["restarts"] == 0
    cluster.kubectl("delete", "rlhfjob", "jsp", "-n", ns, "--wait=false")


def test_jobset_trainer_success_is_succeeded_and_the_budget_is_immutable(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, jobset_doc("jss", max_restarts=2, nodes=1))
    wait_job(cluster, ns, "jss", "Running", 0, log=log)

    patch = cluster.kubectl("patch", "rlhfjob", "jss", "-n", ns, "--type=merge",
                            "-p", json.dumps({"spec": {"runPolicy": {"maxRestarts": 9}}}), check=False)
    assert patch.returncode != 0 and "spec.runPolicy.maxRestarts cannot change" in patch.stderr

    ps = attempt_pods(cluster, ns, "jss", 0, count=3)
    cluster.complete_pod(ns, role(ps, "trainer")[0]["metadata"]["name"])
    j = wait_job(cluster, ns, "jss", "Succeeded", 0, log=log)
    assert condition(j, "Succeeded")["reason"] == "TrainerSucceeded"
    # JobSet stops the servers once the trainer is done; nothing restarts.
    wait_for(lambda: not [p for p in pods(cluster, ns, "jss") if p["metadata"]["labels"]["rlhf.dev/role"] == "rollout"
                          and not p["metadata"].get("deletionTimestamp")], 60, "rollout servers stopped")
    assert job(cluster, ns, "jss")["status"]["phase"] == "Succeeded"
    cluster.kubectl("delete", "rlhfjob", "jss", "-n", ns, "--wait=false")


def test_jobset_suspend_and_resume_keep_the_jobset(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, jobset_doc("jsu", nodes=1))
    wait_job(cluster, ns, "jsu", "Running", 0, log=log)
    uid = cluster.get("jobset", "jsu", namespace=ns)["metadata"]["uid"]
    cluster.kubectl("patch", "rlhfjob", "jsu", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_job(cluster, ns, "jsu", "Suspended", 0, log=log)
    wait_for(lambda: not [p for p in pods(cluster, ns, "jsu") if not p["metadata"].get("deletionTimestamp")], 60,
             "pods deleted while suspended")
    js = cluster.get("jobset", "jsu", namespace=ns)
    assert js["spec"]["suspend"] is True and js["metadata"]["uid"] == uid  # the same JobSet, suspended
    cluster.kubectl("patch", "rlhfjob", "jsu", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    j = wait_job(cluster, ns, "jsu", "Running", 0, log=log)
    assert condition(j, "Suspended")["reason"] == "Resumed"
    attempt_pods(cluster, ns, "jsu", 0, count=3)
    assert cluster.get("jobset", "jsu", namespace=ns)["metadata"]["uid"] == uid
    cluster.kubectl("delete", "rlhfjob", "jsu", "-n", ns, "--wait=false")


def test_jobset_trainer_stopped_by_sigterm_restarts_without_spending_max_restarts(cluster: Cluster, setup):
    """The trainer's exit 143 (it saved a checkpoint after SIGTERM) fails its Job through the
    podFailurePolicy; the Job controller's message matches the JobSet rule `disruption`
    (RestartJobSetAndIgnoreMaxRestarts), so with maxRestarts 0 the job runs again."""
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, jobset_doc("jse", max_restarts=0, nodes=1))
    wait_job(cluster, ns, "jse", "Running", 0, log=log)
    victim = role(attempt_pods(cluster, ns, "jse", 0, count=3), "trainer")[0]["metadata"]["name"]
    cluster.fail_pod(ns, victim, exit_code=143, reason="Error")
    j = wait_job(cluster, ns, "jse", "Running", 1, log=log, timeout=120)
    attempt_pods(cluster, ns, "jse", 1, count=3)
    st = cluster.get("jobset", "jse", namespace=ns)["status"]
    assert st["restarts"] == 1 and st.get("restartsCountTowardsMax", 0) == 0
    assert j["status"]["disruptions"] == 1 and "Disrupted" in events(cluster, ns, "jse")
    cluster.kubectl("delete", "rlhfjob", "jse", "-n", ns, "--wait=false")
