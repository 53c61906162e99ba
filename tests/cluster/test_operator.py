"""The operator (`rlhfctl operator`, a subprocess) against the real control plane: children,
Running, whole-job restarts, the restart budget, permanent exit codes, suspend/resume,
garbage collection, and no duplicates after being killed between two creations.

The main namespace enforces the `restricted` Pod Security level, so every pod the
training-operator and the StatefulSet controller create there proves our security context
is admitted. Multi-node trainers run in a `baseline` namespace: the training-operator (v1)
injects an `init-pytorch` container into Worker pods without a security context, which
`restricted` rejects (a cluster setting: its --pytorch-init-container-template-file).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from .harness import Cluster, free_port, wait_for
from .test_admission import install_crd

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"


def new_namespace(cluster: Cluster, prefix: str, level: str = "restricted") -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}})
    return name


@contextmanager
def operator(cluster: Cluster, ns: str, log: Path, env: dict[str, str] | None = None, metrics_port: int = 0,
             more_namespaces: tuple[str, ...] = (), health_port: int = 0):
    extra = [a for n in more_namespaces for a in ("--namespace", n)] + ["--health-port", str(health_port)]
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf_launcher.cli", "operator", "--namespace", ns, *extra, "--lease-namespace", ns,
             "--lease-duration", "4", "--resync-seconds", "2", "--metrics-port", str(metrics_port)],
            stdout=fh, stderr=subprocess.STDOUT, env={**cluster.env, **(env or {})})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def operator_in_namespace(cluster: Cluster, tmp_path_factory, prefix: str, *, env: dict[str, str] | None = None,
                          metrics_port: int = 0, multi: bool = False):
    """A module's operator: the CRD installed, a new namespace (and a second, baseline one
    with `multi`) watched by a real operator process; yields {ns, multi, log, proc,
    metrics_port}; the namespaces go at the end."""
    install_crd(cluster)
    namespaces = [new_namespace(cluster, prefix)] + ([new_namespace(cluster, f"{prefix}-multi", level="baseline")]
                                                      if multi else [])
    log = tmp_path_factory.mktemp(f"operator-{prefix}") / "operator.log"
    try:
        with operator(cluster, namespaces[0], log, env=env, metrics_port=metrics_port,
                      more_namespaces=tuple(namespaces[1:])) as proc:
            yield {"ns": namespaces[0], "multi": namespaces[-1], "log": log, "proc": proc,
                   "metrics_port": metrics_port}
    finally:
        for n in namespaces:
            cluster.kubectl("delete", "namespace", n, "--wait=false", check=False)


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "op", metrics_port=free_port(), multi=True) as s:
        yield s


def job_doc(name: str, nodes: int = 1, **spec) -> dict:
    base = {"model": {"path": "/models/tiny"}, "data": {"path": "/data/train.jsonl"}, "algorithm": {},
            "rollout": {"replicas": 2, "tensorParallelSize": 1, "image": "example.invalid/vllm:1"},
            "trainer": {"numNodes": nodes, "nprocPerNode": 2, "image": "example.invalid/trainer:1"},
            "schedule": {"promptsPerStep": 8}, "runPolicy": {"maxRestarts": 2},
            # model, data and output on a mounted volume, or the operator refuses the job
            "pod": {"volumes": [{"name": "work", "emptyDir": {}}],
                    "volumeMounts": [{"name": "work", "mountPath": p, "subPath": p.strip("/")}
                                     for p in ("/models", "/data", "/output")]}}
    base.update(spec)
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name}, "spec": base}


def create(cluster: Cluster, ns: str, doc: dict) -> None:
    cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))


def job(cluster: Cluster, ns: str, name: str) -> dict:
    return cluster.get("rlhfjob", name, namespace=ns)


def pods(cluster: Cluster, ns: str, name: str) -> list[dict]:
    return cluster.get("pods", namespace=ns, selector=f"rlhf.dev/job={name}")["items"]


def wait_job(cluster: Cluster, ns: str, name: str, phase: str, restarts: int | None = None, timeout: float = 90,
             log: Path | None = None) -> dict:
    def done():
        j = job(cluster, ns, name)
        st = j.get("status") or {}
        return j if st.get("phase") == phase and (restarts is None or st.get("restarts") == restarts) else None
    try:
        return wait_for(done, timeout, f"{name} {phase} (restarts={restarts})")
    except TimeoutError as err:
        tail = log.read_text()[-4000:] if log and log.exists() else ""
        raise TimeoutError(f"{err}\nstatus: {json.dumps(job(cluster, ns, name).get('status'))}\n{tail}") from None


def running_pods(cluster: Cluster, ns: str, name: str, attempt: int, count: int = 3) -> list[dict]:
    def ready():
        ps = pods(cluster, ns, name)
        if len(ps) == count and all(p["metadata"]["labels"]["rlhf.dev/attempt"] == str(attempt)
                                and p["status"].get("phase") == "Running" for p in ps):
            return ps
        return None
    return wait_for(ready, 60, f"{count} pods of attempt {attempt} Running")


def by_role(ps: list[dict], role: str) -> list[dict]:
    return sorted((p for p in ps if p["metadata"]["labels"]["rlhf.dev/role"] == role),
                  key=lambda p: p["metadata"]["name"])


def condition(j: dict, type_: str) -> dict:
    return next(c for c in j["status"]["conditions"] if c["type"] == type_)


def events(cluster: Cluster, ns: str, name: str) -> list[str]:
    evs = cluster.get("events", namespace=ns)["items"]
    return [e["reason"] for e in sorted(evs, key=lambda e: e["metadata"]["creationTimestamp"])
            if e["involvedObject"]["name"] == name and e["involvedObject"]["kind"] == "RLHFJob"]


def test_valid_job_gets_its_children_and_runs(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, job_doc("run"))
    j = wait_job(cluster, ns, "run", "Running", 0, log=log)
    uid = j["metadata"]["uid"]
    assert j["status"]["observedGeneration"] == j["metadata"]["generation"]
    assert j["status"]["progress"]["totalSteps"] == 100
    assert condition(j, "Running")["reason"] == "AllPodsRunning"

    names = cluster.kubectl("get", "configmap,serviceaccount,role,rolebinding,service,networkpolicy,statefulset,"
                            "pytorchjob", "-n", ns, "-l", "rlhf.dev/job=run", "-o", "name").stdout.split()
    assert sorted(names) == sorted([
        "configmap/run-config", "serviceaccount/run-trainer", "role.rbac.authorization.k8s.io/run-trainer",
        "rolebinding.rbac.authorization.k8s.io/run-trainer", "service/run-rollout", "service/run-weight-sync",
        "networkpolicy.networking.k8s.io/run", "statefulset.apps/run-rollout", "pytorchjob.kubeflow.org/run-trainer"])
    for kind_name in names:
        obj = json.loads(cluster.kubectl("get", kind_name, "-n", ns, "-o", "json").stdout)
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True

    ps = running_pods(cluster, ns, "run", 0)
    assert [p["metadata"]["name"] for p in by_role(ps, "rollout")] == ["run-rollout-0", "run-rollout-1"]
    assert [p["metadata"]["name"] for p in by_role(ps, "trainer")] == ["run-trainer-master-0"]
    for p in by_role(ps, "rollout"):
        assert p["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"
    master = by_role(ps, "trainer")[0]
    env = {e["name"]: e.get("value") for e in master["spec"]["containers"][0]["env"]}
    assert env["RLHF_ROLLOUT_ENDPOINTS"] == (f"http://run-rollout-0.run-rollout.{ns}.svc:8000,"
                                             f"http://run-rollout-1.run-rollout.{ns}.svc:8000")
    assert env["PET_NNODES"] == "1" and env["PET_NPROC_PER_NODE"] == "2" and "PET_MASTER_ADDR" in env
    assert master["spec"]["containers"][0]["resources"]["limits"][GPU] == "2"
    # The weight-sync Service selects exactly trainer rank 0.
    eps = cluster.get("endpointslices", namespace=ns, selector="kubernetes.io/service-name=run-weight-sync")["items"]
    targets = [e["targetRef"]["name"] for s in eps for e in s.get("endpoints") or []]
    assert targets == ["run-trainer-master-0"]

    table = cluster.kubectl("get", "rlj", "run", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"]
    assert table[1].split()[:2] == ["run", "Running"]
    wait_for(lambda: {"Pending", "Running"} <= set(events(cluster, ns, "run")), 10, "Pending and Running events")

    def metrics_text():
        return urllib.request.urlopen(f"http://127.0.0.1:{setup['metrics_port']}/metrics", timeout=5).read().decode()
    def gauge_counts_running():
        text = metrics_text()
        return text if 'rlhf_operator_jobs{phase="Running"} 1.0' in text else None
    text = wait_for(gauge_counts_running, 10, "the jobs-by-phase gauge")
    counts = {t: float(v) for t, v in re.findall(r'rlhf_operator_reconciles_total\{trigger="(\w+)"\} (\S+)', text)}
    assert counts["pod"] > 0 and counts["resync"] > 0, counts  # the series exist at 0 from the start
    # every reconcile read the children from kopf's indexes, none from the API server (audits come after 5 min)
    reads = {s: float(v) for s, v in re.findall(r'rlhf_operator_child_reads_total\{source="(\w+)"\} (\S+)', text)}
    assert reads["index"] > 0 and reads["api"] == 0, reads
    assert "rlhf_operator_reconcile_duration_seconds_bucket" in text and "rlhf_operator_leader 1.0" in text
    # one info series per job, labelled for per-job alerts; the work queue's depth and wait
    assert f'rlhf_operator_job_info{{namespace="{ns}",phase="Running",rlhf_job="run"}} 1.0' in text
    assert "rlhf_operator_workqueue_depth" in text and "rlhf_operator_workqueue_wait_seconds_count" in text

    # The trainer's service account may patch its own job's status, and nothing else.
    def can(verb: str, resource: str, sub: str = "") -> str:
        args = ["auth", "can-i", verb, resource, "-n", ns, f"--as=system:serviceaccount:{ns}:run-trainer"]
        return cluster.kubectl(*args, *(["--subresource", sub] if sub else []), check=False).stdout.strip()
    assert can("patch", "rlhfjobs.rlhf.dev/run", "status") == "yes"
    assert can("patch", "rlhfjobs.rlhf.dev/other", "status") == "no"
    assert can("patch", "rlhfjobs.rlhf.dev/run") == "no"
    assert can("delete", "pods") == "no"

    # A progress patch made with the job's own service-account token shows in `kubectl get
    # rlj`; the same token cannot patch another job.
    token = cluster.kubectl("create", "token", "run-trainer", "-n", ns).stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    sa_config = Path(cluster.kubeconfig).parent / f"sa-{ns}.kubeconfig"
    sa_config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": "trainer", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": "trainer", "namespace": ns}}],
    }))

    def as_trainer(job: str) -> subprocess.CompletedProcess:
        return subprocess.run([cluster.bin("kubectl"), f"--kubeconfig={sa_config}", "patch", "rlj", job,
                               "--subresource=status", "--type=merge",
                               "-p", '{"status": {"progress": {"step": 5, "rewardMean": 0.75}}}'],
                              capture_output=True, text=True, timeout=60)

    mine = as_trainer("run")
    assert mine.returncode == 0, mine.stderr
    other = as_trainer("other")
    assert other.returncode != 0 and "forbidden" in other.stderr.lower()
    wait_for(lambda: cluster.kubectl("get", "rlj", "run", "-n", ns).stdout.splitlines()[1].split()[2:4] == ["5", "0.75"],
             15, "the trainer's progress in `kubectl get rlj`")

    # Deleting the job garbage-collects every child and pod.
    cluster.kubectl("delete", "rlhfjob", "run", "-n", ns)
    wait_for(lambda: not cluster.kubectl("get", "configmap,serviceaccount,role,rolebinding,service,networkpolicy,"
                                         "statefulset,pytorchjob,pods", "-n", ns, "-l", "rlhf.dev/job=run",
                                         "-o", "name").stdout.split(), 60, "children garbage-collected")


def test_failed_pods_restart_the_whole_job_until_the_budget_ends(cluster: Cluster, setup):
    ns, log = setup["multi"], setup["log"]
    create(cluster, ns, job_doc("rs", nodes=2))
    wait_job(cluster, ns, "rs", "Running", 0, log=log)
    ps = running_pods(cluster, ns, "rs", 0, count=4)
    assert sorted(p["metadata"]["name"] for p in by_role(ps, "trainer")) == ["rs-trainer-master-0",
                                                                             "rs-trainer-worker-0"]

    # A trainer pod fails: one restart of everything, attempt 1 on every new pod.
    old_uids = {p["metadata"]["uid"] for p in ps}
    cluster.fail_pod(ns, "rs-trainer-worker-0", exit_code=137, reason="OOMKilled")
    wait_job(cluster, ns, "rs", "Running", 1, log=log)
    ps = running_pods(cluster, ns, "rs", 1, count=4)
    assert not old_uids & {p["metadata"]["uid"] for p in ps}
    j = job(cluster, ns, "rs")
    assert condition(j, "Restarting")["status"] == "False"
    assert "rs-trainer-worker-0" in condition(j, "Restarting")["message"]

    # A rollout server fails: the second restart.
    cluster.fail_pod(ns, "rs-rollout-1", exit_code=1)
    wait_job(cluster, ns, "rs", "Running", 2, log=log)
    running_pods(cluster, ns, "rs", 2, count=4)

    # The budget (maxRestarts 2) is spent: the next failure ends in Failed, naming pod and code.
    cluster.fail_pod(ns, "rs-trainer-master-0", exit_code=137, reason="OOMKilled")
    j = wait_job(cluster, ns, "rs", "Failed", 2, log=log)
    failed = condition(j, "Failed")
    assert failed["reason"] == "RestartLimitExceeded"
    assert "rs-trainer-master-0" in failed["message"] and "code 137" in failed["message"]
    reasons = events(cluster, ns, "rs")
    assert reasons.count("PodFailed") == 2 and reasons.count("RestartLimitExceeded") == 1
    wait_for(lambda: not cluster.kubectl("get", "statefulset", "-n", ns, "-l", "rlhf.dev/job=rs", "-o",
                                         "name").stdout.strip(), 30, "rollout servers stopped")

    # A Failed job is never brought back by deleting its children.
    cluster.kubectl("delete", "pytorchjob", "rs-trainer", "-n", ns)
    cluster.kubectl("delete", "configmap", "rs-config", "-n", ns)
    time.sleep(6)  # three resyncs
    assert job(cluster, ns, "rs")["status"]["phase"] == "Failed"
    left = cluster.kubectl("get", "statefulset,pytorchjob,configmap", "-n", ns, "-l", "rlhf.dev/job=rs",
                           "-o", "name").stdout.split()
    assert left == []
    wait_for(lambda: not pods(cluster, ns, "rs"), 30, "no pods of the failed job")
    cluster.kubectl("delete", "rlhfjob", "rs", "-n", ns, "--wait=false")


def test_permanent_exit_code_fails_at_once(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, job_doc("perm", runPolicy={"maxRestarts": 5}))
    wait_job(cluster, ns, "perm", "Running", 0, log=log)
    running_pods(cluster, ns, "perm", 0)
    cluster.fail_pod(ns, "perm-trainer-master-0", exit_code=2, reason="Error", message="bad config")
    j = wait_job(cluster, ns, "perm", "Failed", 0, log=log)
    assert condition(j, "Failed")["reason"] == "PermanentError"
    assert "exited with code 2" in condition(j, "Failed")["message"]
    cluster.kubectl("delete", "rlhfjob", "perm", "-n", ns, "--wait=false")


def test_an_evicted_pod_restarts_the_job_without_spending_its_budget(cluster: Cluster, setup):
    """A drain's eviction (the Eviction API marks the pod DisruptionTarget, then deletes it):
    the whole job restarts, resuming from its checkpoint, and maxRestarts 0 is not spent."""
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, job_doc("ev", runPolicy={"maxRestarts": 0}))
    wait_job(cluster, ns, "ev", "Running", 0, log=log)
    running_pods(cluster, ns, "ev", 0)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "ev-rollout-0", "namespace": ns}}
    cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{ns}/pods/ev-rollout-0/eviction", "-f", "-",
                    input=json.dumps(eviction))
    j = wait_job(cluster, ns, "ev", "Running", 1, log=log)
    running_pods(cluster, ns, "ev", 1)
    assert j["status"]["disruptions"] == 1
    assert "DisruptionTarget: EvictionByEvictionAPI" in condition(j, "Restarting")["message"]
    assert "Disrupted" in events(cluster, ns, "ev") and "PodFailed" not in events(cluster, ns, "ev")
    cluster.kubectl("delete", "rlhfjob", "ev", "-n", ns, "--wait=false")


def test_suspend_and_resume(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, job_doc("sus"))
    wait_job(cluster, ns, "sus", "Running", 0, log=log)
    cluster.kubectl("patch", "rlhfjob", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_job(cluster, ns, "sus", "Suspended", 0, log=log)
    wait_for(lambda: not pods(cluster, ns, "sus"), 60, "pods deleted while suspended")
    assert cluster.kubectl("get", "configmap", "sus-config", "-n", ns, check=False).returncode == 0
    cluster.kubectl("patch", "rlhfjob", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    j = wait_job(cluster, ns, "sus", "Running", 0, log=log)
    assert condition(j, "Suspended")["status"] == "False" and condition(j, "Suspended")["reason"] == "Resumed"
    running_pods(cluster, ns, "sus", 0)
    assert "Suspended" in events(cluster, ns, "sus")
    cluster.kubectl("delete", "rlhfjob", "sus", "-n", ns, "--wait=false")


def test_killed_between_two_creations_leaves_no_duplicates(cluster: Cluster, tmp_path):
    """The real operator is frozen (SIGSTOP) the moment its log says it created the job's
    first child, then killed (SIGKILL): some children exist, not all. A new operator
    finishes the job and duplicates nothing."""
    ns = new_namespace(cluster, "kill")
    log = tmp_path / "operator.log"
    try:
        create(cluster, ns, job_doc("dup"))
        with operator(cluster, ns, log) as proc:
            deadline = time.monotonic() + 60
            while "created " not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.002)
            os.kill(proc.pid, signal.SIGSTOP)
            made = cluster.kubectl("get", "configmap,serviceaccount,role,rolebinding,service,networkpolicy,"
                                   "statefulset,pytorchjob", "-n", ns, "-l", "rlhf.dev/job=dup",
                                   "-o", "name").stdout.split()
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert 1 <= len(made) < 9, made  # killed between two creations
        with operator(cluster, ns, log):
            wait_job(cluster, ns, "dup", "Running", 0, log=log)
            running_pods(cluster, ns, "dup", 0)
            out = cluster.kubectl("get", "configmap,serviceaccount,role,rolebinding,service,networkpolicy,"
                                  "statefulset,pytorchjob", "-n", ns, "-o", "name").stdout.split()
            ours = [n for n in out if not n.endswith("/kube-root-ca.crt") and n != "serviceaccount/default"
                    and "run-trainer-" not in n]
            # the PyTorchJob's own per-pod headless services are the training-operator's
            ours = [n for n in ours if not n.startswith("service/dup-trainer-")]
            assert sorted(ours) == sorted(set(ours)) and len(ours) == 9, ours
            assert len(pods(cluster, ns, "dup")) == 3
            cluster.kubectl("delete", "rlhfjob", "dup", "-n", ns)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_deadline_then_ttl(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    create(cluster, ns, job_doc("ttl", runPolicy={"activeDeadlineSeconds": 4, "ttlSecondsAfterFinished": 2}))
    j = wait_job(cluster, ns, "ttl", "Failed", 0, timeout=30, log=log)
    assert condition(j, "Failed")["reason"] == "DeadlineExceeded"
    wait_for(lambda: cluster.kubectl("get", "rlhfjob", "ttl", "-n", ns, check=False).returncode != 0, 30,
             "the job deleted after ttlSecondsAfterFinished")


def _get(port: int, path: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _leader_gauge(port: int) -> float:
    line = next(l for l in _get(port, "/metrics")[1].splitlines() if l.startswith("rlhf_operator_leader "))
    return float(line.split()[1])


def test_only_the_lease_holder_acts(cluster: Cluster, tmp_path):
    """Two replicas: both serve metrics and probes, exactly one leads; the leader SIGKILLed
    (its lease not released) is replaced within the lease time and nothing is made twice;
    a stopped (stuck) replica fails its liveness probe."""
    ns = new_namespace(cluster, "lease")
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    ports = {name: (free_port(), free_port()) for name in ("a", "b")}  # (metrics, health)
    try:
        with operator(cluster, ns, first, metrics_port=ports["a"][0], health_port=ports["a"][1]) as a:
            wait_for(lambda: "leader:" in first.read_text(), 30, "the first operator leads")
            with operator(cluster, ns, second, metrics_port=ports["b"][0], health_port=ports["b"][1]) as b:
                wait_for(lambda: "waiting for lease" in second.read_text(), 30, "the second operator waits")
                wait_for(lambda: _get(ports["b"][0], "/metrics")[0] == 200, 30, "the standby serves metrics")
                assert _leader_gauge(ports["a"][0]) == 1 and _leader_gauge(ports["b"][0]) == 0
                for name in ("a", "b"):
                    wait_for(lambda: _get(ports[name][1], "/healthz")[0] == 200, 30, f"{name} is live")
                    assert _get(ports[name][1], "/readyz")[0] == 200
                assert "leading" in _get(ports["a"][1], "/healthz")[1]
                assert "waiting for the leader lease" in _get(ports["b"][1], "/healthz")[1]
                create(cluster, ns, job_doc("one"))
                wait_job(cluster, ns, "one", "Running", 0, log=first)
                assert "leader:" not in second.read_text() and f"{ns}/one" not in second.read_text()
                a.kill()  # SIGKILL: the lease is not released, the standby waits out its duration (4 s)
                a.wait(timeout=15)
                killed = time.monotonic()
                wait_for(lambda: "leader:" in second.read_text(), 30, "the second operator takes over")
                assert time.monotonic() - killed < 4 + 6  # the lease time, plus polling and the API's latency
                assert _leader_gauge(ports["b"][0]) == 1
                cluster.kubectl("patch", "rlhfjob", "one", "-n", ns, "--type=merge", "-p",
                                '{"spec":{"suspend":true}}')
                wait_job(cluster, ns, "one", "Suspended", 0, log=second)
                assert len(cluster.get("pytorchjobs.kubeflow.org", namespace=ns)["items"]) <= 1  # nothing made twice
                assert len(cluster.get("statefulsets.apps", namespace=ns)["items"]) <= 1
                assert len(cluster.get("configmaps", namespace=ns, selector="rlhf.dev/job=one")["items"]) == 1
                assert b.poll() is None
                os.kill(b.pid, signal.SIGSTOP)  # stuck: the probe gets no answer, as the kubelet would see
                try:
                    with pytest.raises(OSError):
                        _get(ports["b"][1], "/healthz", timeout=2)
                finally:
                    os.kill(b.pid, signal.SIGCONT)
                wait_for(lambda: _get(ports["b"][1], "/healthz")[0] == 200, 30, "live again once continued")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_built_children_of_the_cluster_example_pass_server_validation(cluster: Cluster, setup):
    """Every child of examples/rlhfjob.yaml, as the builders make it, is accepted by the API
    server and the training-operator's webhook (server-side dry run)."""
    from rlhf_contract.api import load_job
    from rlhf_operator.backends import build_children

    ns = setup["multi"]
    job = load_job(Path(__file__).resolve().parents[2] / "examples" / "rlhfjob.yaml")
    job.metadata.namespace = ns
    job.metadata.__pydantic_extra__["uid"] = str(uuid.uuid4())
    for child in build_children(job, attempt=0):
        proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(child), check=False)
        assert proc.returncode == 0, f"{child['kind']}: {proc.stderr}"


def test_sft_job_gets_a_trainer_and_no_rollout_servers(cluster: Cluster, setup):
    ns, log = setup["ns"], setup["log"]
    doc = job_doc("sft", method="sft")
    for field in ("rollout", "algorithm"):  # only RL reads them
        doc["spec"].pop(field)
    create(cluster, ns, doc)
    j = wait_job(cluster, ns, "sft", "Running", 0, log=log)
    assert condition(j, "Running")["message"] == "1/1 trainer running"
    names = cluster.kubectl("get", "configmap,service,statefulset,pytorchjob", "-n", ns, "-l", "rlhf.dev/job=sft",
                            "-o", "name").stdout.split()
    assert sorted(names) == ["configmap/sft-config", "pytorchjob.kubeflow.org/sft-trainer"]
    (trainer,) = running_pods(cluster, ns, "sft", 0, count=1)
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    assert not env.get("RLHF_ROLLOUT_ENDPOINTS")  # no servers to reach
    config = json.loads(cluster.get("configmap", "sft-config", namespace=ns)["data"]["trainer.json"])
    assert config["method"] == "sft"


def test_a_colocated_job_is_one_trainer_pod_with_its_servers_inside(cluster: Cluster, setup):
    """rollout.placement colocated: the training-operator accepts the one PyTorchJob, no
    rollout StatefulSet or Service is made, and the job runs on its trainer pod alone."""
    ns, log = setup["ns"], setup["log"]
    doc = job_doc("coloc", rollout={"placement": "colocated", "replicas": 2, "tensorParallelSize": 1,
                                    "vllm": {"kvCacheMemoryBytes": 8 * 2**30}})
    create(cluster, ns, doc)
    j = wait_job(cluster, ns, "coloc", "Running", 0, log=log)
    assert condition(j, "Running")["message"] == "1/1 trainer running"
    names = cluster.kubectl("get", "configmap,service,statefulset,pytorchjob", "-n", ns, "-l", "rlhf.dev/job=coloc",
                            "-o", "name").stdout.split()
    assert sorted(names) == ["configmap/coloc-config", "pytorchjob.kubeflow.org/coloc-trainer"]
    (trainer,) = running_pods(cluster, ns, "coloc", 0, count=1)
    container = trainer["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert container["command"][-1] == "rlhf_trainer.supervise"
    servers = json.loads(env["RLHF_SUPERVISE"])["servers"]
    assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1"]
    assert env["RLHF_ROLLOUT_ENDPOINTS"] == "http://127.0.0.1:8000,http://127.0.0.1:8001"
