"""Kueue v0.17.0 (the real controller and its JobSet and TrainJob webhooks, built by
tests/cluster/kueue/build.sh, skipped until then) in front of the operator's JobSet backend:
a ClusterQueue with a GPU quota admits a job whole (trainer and rollout servers together) or
not at all; the priority-class label reaches the JobSet, and a higher-priority job preempts a
running one, which Kueue suspends (pods gone, restart budget and checkpoints kept) and admits
again once the quota is free. And in front of the TrainJob backend on Kubeflow Trainer v2.3
(tests/cluster/trainer/build.sh): Kueue admits a TrainJob whole through its runtime patch
(Kueue's own `runtimePatches` entry beside the operator's) or holds it suspended."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from . import pki, trainer_v2
from .harness import Cluster, free_port, wait_for
from .procs import http_ok, terminate
from .test_jobset import attempt_pods, jobset_doc
from .test_operator import create, job, operator_in_namespace, pods, wait_job

pytestmark = pytest.mark.cluster

BUILD = Path(__file__).parent / "kueue" / "build.sh"
KUEUE = "kueue.x-k8s.io/v1beta2"
PRIORITY = "kueue.x-k8s.io/priority-class"
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
WEBHOOK_PATHS = ("jobset", "trainjob", "kueue-x-k8s-io")  # JobSets, TrainJobs, Kueue's own; no pod, Job or other


def _webhooks(manifests: Path, port: int, certs: Path) -> list[dict]:
    docs = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        doc["metadata"] = {"name": f"kueue-{doc['kind'].removesuffix('WebhookConfiguration').lower()}"}
        doc["webhooks"] = [h for h in doc["webhooks"] if any(p in h["clientConfig"]["service"]["path"]
                                                            for p in WEBHOOK_PATHS)]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": pki.b64(certs / "ca.crt")}
            hook["timeoutSeconds"] = 10
        docs.append(doc)
    return docs


@pytest.fixture(scope="module")
def kueue(cluster: Cluster, tmp_path_factory):
    bin_dir = Path(subprocess.run(["bash", str(BUILD), "--print"], capture_output=True, text=True).stdout.strip())
    if not (bin_dir / ".complete").exists():
        pytest.skip("Kueue is not built: `bash tests/cluster/kueue/build.sh` (a few minutes, once)")
    certs, port, health = pki.webhook_pki(), free_port(), free_port()
    # Without its internal cert management (which would name an in-cluster Service) Kueue reads
    # its metrics certificate from this fixed path, as the training-operator its webhook's.
    try:
        METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            shutil.copyfile(certs / name, METRICS_CERTS / name)
    except OSError as err:
        pytest.skip(f"Kueue needs its metrics certificate in {METRICS_CERTS}: {err}")
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kueue-system"}})  # its own
    cluster.kubectl("apply", "--server-side", "-f", str(bin_dir / "crd"))
    trainer = trainer_v2.built()
    frameworks = ["jobset.x-k8s.io/jobset"]
    if trainer is not None:  # Trainer's CRDs before Kueue starts: its TrainJob integration sets up at once
        for crd in sorted((trainer / "crds").glob("trainer.kubeflow.org_*.yaml")):
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
        cluster.wait_established("trainjobs.trainer.kubeflow.org")
        frameworks.append("trainer.kubeflow.org/trainjob")
    for crd in ("clusterqueues", "localqueues", "workloads", "resourceflavors", "workloadpriorityclasses"):
        cluster.wait_established(f"{crd}.kueue.x-k8s.io")
    hooks = _webhooks(bin_dir / "webhook" / "manifests.yaml", port, certs)
    root = tmp_path_factory.mktemp("kueue")
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "metrics": {"bindAddress": "0"}, "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
        "integrations": {"frameworks": frameworks},
    }))
    log = open(root / "kueue.log", "ab")
    proc = subprocess.Popen([str(bin_dir / "kueue"), f"--config={config}", "--feature-gates=VisibilityOnDemand=false",
                             "--zap-log-level=2"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is None and http_ok(f"http://127.0.0.1:{health}/readyz"), 120,
                 "kueue /readyz")
        cluster.apply(*hooks)  # only once it serves them (they fail closed)
        cluster.apply(
            {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": "gpu"}},
            {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": "gpus"},
             "spec": {"namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
                          {"name": "gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": 4}]}]}]}},
            {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10},
            {"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": "high"}, "value": 1000},
        )
        yield {"log": root / "kueue.log"}
    finally:
        for doc in hooks:  # they fail closed: gone before Kueue is
            cluster.kubectl("delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found", check=False)
        terminate([proc.pid])
        log.close()


@pytest.fixture(scope="module")
def setup(cluster: Cluster, kueue, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "kueue") as s:
        cluster.apply({"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "team", "namespace": s["ns"]},
                       "spec": {"clusterQueue": "gpus"}})
        yield s


def queued(name: str, *, nodes: int = 1, priority: str | None = None) -> dict:
    """A JobSet job on the queue `team`: `nodes` trainer pods of 2 GPUs, 2 servers of 1."""
    doc = jobset_doc(name, max_restarts=1, queue="team", nodes=nodes)
    if priority:
        doc["metadata"]["labels"][PRIORITY] = priority
    return doc


def live_pods(cluster: Cluster, ns: str, name: str) -> list[dict]:
    return [p for p in pods(cluster, ns, name) if not p["metadata"].get("deletionTimestamp")]


def test_a_job_is_admitted_whole_or_not_at_all(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, queued("big", nodes=2))  # 4 + 2 GPUs: more than the queue's 4
    wait_job(cluster, ns, "big", "Pending", 0, log=log)
    wait_for(lambda: cluster.get("workloads", namespace=ns)["items"], 60, "Kueue's workload of the job")
    (wl,) = cluster.get("workloads", namespace=ns)["items"]
    assert sorted(ps["name"] for ps in wl["spec"]["podSets"]) == ["rollout", "trainer"]  # one workload, both roles
    assert sum(ps["count"] for ps in wl["spec"]["podSets"]) == 4
    wait_for(lambda: "waiting for admission" in (job(cluster, ns, "big").get("status") or {}).get("message", ""),
             60, "the job held by Kueue")
    assert cluster.get("jobset", "big", namespace=ns)["spec"]["suspend"] is True
    assert live_pods(cluster, ns, "big") == []  # neither the trainer nor a server started
    cluster.kubectl("delete", "rlhfjob", "big", "-n", ns)

    create(cluster, ns, queued("fits"))  # 2 + 2 GPUs
    wait_job(cluster, ns, "fits", "Running", 0, log=log, timeout=120)
    assert len(attempt_pods(cluster, ns, "fits", 0, count=3)) == 3  # trainer and both servers together
    cluster.kubectl("delete", "rlhfjob", "fits", "-n", ns)
    wait_for(lambda: not live_pods(cluster, ns, "fits"), 60, "pods of fits gone")


def test_a_higher_priority_job_preempts_a_running_one_which_resumes_later(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, queued("low", priority="low"))
    wait_job(cluster, ns, "low", "Running", 0, log=log, timeout=120)
    assert cluster.get("jobset", "low", namespace=ns)["metadata"]["labels"][PRIORITY] == "low"
    create(cluster, ns, queued("high", priority="high"))
    wait_job(cluster, ns, "high", "Running", 0, log=log, timeout=120)
    # the low job is suspended by Kueue: pods gone, nothing spent, waiting for admission
    j = wait_job(cluster, ns, "low", "Pending", 0, log=log, timeout=60)
    assert cluster.get("jobset", "low", namespace=ns)["spec"]["suspend"] is True
    wait_for(lambda: not live_pods(cluster, ns, "low"), 60, "the preempted job's pods gone")
    assert j["status"]["restarts"] == 0 and not j["status"].get("disruptions")
    wl = next(w for w in cluster.get("workloads", namespace=ns)["items"]
              if w["metadata"]["ownerReferences"][0]["name"] == "low")
    assert any(c["type"] == "Preempted" and c["status"] == "True" for c in wl["status"]["conditions"])
    # the quota comes back: the same JobSet runs again (its trainer resumes from the newest checkpoint)
    cluster.kubectl("delete", "rlhfjob", "high", "-n", ns)
    wait_job(cluster, ns, "low", "Running", 0, log=log, timeout=120)
    attempt_pods(cluster, ns, "low", 0, count=3)
    cluster.kubectl("delete", "rlhfjob", "low", "-n", ns)


@pytest.fixture(scope="module")
def trainer(cluster: Cluster, kueue, tmp_path_factory):
    bin_dir = trainer_v2.built()
    if bin_dir is None:
        pytest.skip("Kubeflow Trainer v2.3 is not built: `make trainer-bin`")
    with trainer_v2.trainer_controller(cluster, bin_dir, tmp_path_factory.mktemp("trainer")) as log:
        yield log


def queued_trainjob(name: str, nodes: int) -> dict:
    """An sft job as a TrainJob on the queue `team` (the trainer's pods are all it has: Kueue
    admits it whole): `nodes` pods of 2 GPUs."""
    from .test_trainjob import trainjob_doc

    doc = trainjob_doc(name, nodes=nodes, method="sft")
    for key in ("rollout", "schedule", "algorithm"):  # what an sft job has not
        doc["spec"].pop(key)
    doc["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    return doc


def _trainjob_story(cluster: Cluster, ns: str, name: str, kueue_log: Path, trainer_log: Path) -> str:
    """What Kueue and Trainer made of a TrainJob, for a failure's message."""
    tj = cluster.kubectl("get", "trainjob", f"{name}-trainer", "-n", ns, "-o", "yaml", check=False).stdout
    wls = cluster.kubectl("get", "workloads", "-n", ns, "-o", "yaml", check=False).stdout
    tail = lambda path: "\n".join(l for l in path.read_text(errors="replace").splitlines()
                                   if name in l and "Reconciler error" not in l)[-4000:]
    return f"TrainJob:\n{tj}\nworkloads:\n{wls[-4000:]}\nkueue:\n{tail(kueue_log)}\ntrainer:\n{tail(trainer_log)}"


def test_kueue_admits_a_trainjob_whole_through_its_runtime_patch_or_holds_it(cluster: Cluster, setup, kueue, trainer):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, queued_trainjob("tjbig", nodes=3))  # 6 GPUs: more than the queue's 4
    wait_for(lambda: cluster.get("workloads", namespace=ns)["items"], 60, "Kueue's workload of the TrainJob")
    (wl,) = cluster.get("workloads", namespace=ns)["items"]
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "TrainJob"
    assert [(ps["name"], ps["count"]) for ps in wl["spec"]["podSets"]] == [("node", 3)]
    assert cluster.get("trainjob", "tjbig-trainer", namespace=ns)["spec"]["suspend"] is True  # Kueue's webhook
    assert live_pods(cluster, ns, "tjbig") == [] and job(cluster, ns, "tjbig")["status"]["phase"] != "Running"
    cluster.kubectl("delete", "rlhfjob", "tjbig", "-n", ns)

    create(cluster, ns, queued_trainjob("tjfits", nodes=2))  # 4 GPUs
    try:
        wait_job(cluster, ns, "tjfits", "Running", 0, log=log, timeout=120)
    except TimeoutError as err:
        raise AssertionError(f"{err}\n{_trainjob_story(cluster, ns, 'tjfits', kueue['log'], trainer)}") from None
    tj = cluster.get("trainjob", "tjfits-trainer", namespace=ns)
    assert tj["spec"].get("suspend") is False
    assert {p["manager"] for p in tj["spec"]["runtimePatches"]} == {"rlhf.dev/operator", "kueue.x-k8s.io/manager"}
    wl = next(w for w in cluster.get("workloads", namespace=ns)["items"]
              if w["metadata"]["ownerReferences"][0]["name"] == "tjfits-trainer")
    assert any(c["type"] == "Admitted" and c["status"] == "True" for c in wl["status"]["conditions"])
    ps = wait_for(lambda: (lambda got: got if len(got) == 2 and all(
        p["status"].get("phase") == "Running" for p in got) else None)(live_pods(cluster, ns, "tjfits")),
        90, "both trainer pods Running")
    assert {p["metadata"]["labels"]["rlhf.dev/role"] for p in ps} == {"trainer"}
    cluster.kubectl("delete", "rlhfjob", "tjfits", "-n", ns)
    wait_for(lambda: not live_pods(cluster, ns, "tjfits"), 60, "pods of tjfits gone")
