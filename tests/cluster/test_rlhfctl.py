"""`rlhfctl submit / get / logs / delete / env` against the real API server, with a real
operator (`rlhfctl operator`) in a `restricted` namespace: a working directory goes into a
ConfigMap owned by the job and the operator's pods mount it where the rewritten job reads
it; `--wait` ends with the run's own exit code; a too-large directory creates nothing.

Logs come through the API server from kwok, which plays each fake node's kubelet and serves
every container's log from one file (`Cluster.append_pod_log`): what is tested is finding
the pods of a role and attempt, prefixes, `--tail` and `--follow`, not what a trainer
writes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from rlhf_contract.pod import trainer_log_path
from rlhf_launcher.cli import main
from rlhf_launcher.workdir import MIB, WORKDIR_MOUNT, WORKDIR_VOLUME

from .harness import Cluster, wait_for
from .kwok import EXEC_POD
from .test_chart_install import sa_kubeconfig
from .test_operator import create, job_doc, operator_in_namespace, running_pods, wait_job

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "ctl") as s:
        yield s


def rlhfctl(cluster: Cluster, capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--kubeconfig", str(cluster.kubeconfig)])
    out, err = capsys.readouterr()
    return code, out, err


def workdir_job(tmp_path: Path, name: str) -> Path:
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / "reward.py").write_text("def reward_fn(response, answer, extra_info):\n    return float(response == answer)\n")
    (wd / "data" / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    doc = job_doc(name, data={"path": str(wd / "data" / "train.jsonl")},
                  reward={"type": "python", "file": str(wd / "reward.py")})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    return wd


def test_submit_with_a_working_dir_then_get_logs_delete(cluster: Cluster, setup, tmp_path, capsys):
    ns, name = setup["ns"], "wd"
    wd = workdir_job(tmp_path, name)
    code, out, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "--working-dir", str(wd), "-n", ns)
    assert code == 0, err
    assert f"configmap/{name}-workdir created (2 files" in out and f"rlhfjob/{name} created in namespace {ns}" in out
    j = wait_job(cluster, ns, name, "Running", 0, log=setup["log"])
    cm = cluster.get("configmap", f"{name}-workdir", namespace=ns)
    assert cm["data"] == {"reward.py": (wd / "reward.py").read_text(), "data--train.jsonl": (wd / "data/train.jsonl").read_text()}
    assert cm["metadata"]["ownerReferences"] == [{"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "name": name,
                                                  "uid": j["metadata"]["uid"]}]
    # the operator's children: every pod mounts it, and the trainer's config names the mounted files
    config = json.loads(next(iter(cluster.get("configmap", f"{name}-config", namespace=ns)["data"].values())))
    assert config["spec"]["reward"]["file"] == f"{WORKDIR_MOUNT}/reward.py"
    assert config["spec"]["data"]["path"] == f"{WORKDIR_MOUNT}/data/train.jsonl"
    pods = running_pods(cluster, ns, name, 0, count=3)  # 2 rollout servers, 1 trainer
    for pod in pods:
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == WORKDIR_VOLUME]
        assert volume["projected"]["sources"] == [{"configMap": {"name": f"{name}-workdir", "items": [
            {"key": "data--train.jsonl", "path": "data/train.jsonl"}, {"key": "reward.py", "path": "reward.py"}]}}]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": WORKDIR_VOLUME, "mountPath": WORKDIR_MOUNT, "readOnly": True} in mounts, pod["metadata"]["name"]

    code, out, _ = rlhfctl(cluster, capsys, "get", "-n", ns)
    assert code == 0 and [line.split()[:2] for line in out.splitlines()[1:]] == [[name, "Running"]]
    code, out, _ = rlhfctl(cluster, capsys, "get", name, "-n", ns, "-o", "json")
    assert code == 0 and json.loads(out)["status"]["phase"] == "Running"
    code, out, _ = rlhfctl(cluster, capsys, "get", name, "-n", ns)
    assert code == 0 and "Running" in out and "AllPodsRunning" in out

    check_logs(cluster, capsys, ns, name)

    # a second submit of the same name creates nothing
    code, _, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "--working-dir", str(wd), "-n", ns)
    assert code == 1 and "already exists" in err

    code, out, _ = rlhfctl(cluster, capsys, "delete", name, "-n", ns)
    assert code == 0 and f"rlhfjob/{name} deleted" in out
    selector = f"rlhf.dev/workdir-of={name}"
    wait_for(lambda: not cluster.get("configmaps", namespace=ns, selector=selector)["items"], 60,
             "the working-directory ConfigMap collected with its job")
    code, _, err = rlhfctl(cluster, capsys, "delete", name, "-n", ns)
    assert code == 1 and "not found" in err


def check_logs(cluster: Cluster, capsys, ns: str, name: str) -> None:
    line = f"step 7 reward 0.25 {uuid.uuid4().hex}"
    cluster.append_pod_log(line)
    code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns)  # one trainer pod: its lines as they are
    assert code == 0 and out.splitlines()[-1] == line
    code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--role", "rollout", "--tail", "1")
    assert code == 0 and out.splitlines() == [f"[{name}-rollout-0] {line}", f"[{name}-rollout-1] {line}"]
    code, _, err = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--role", "sandbox")
    assert code == 1 and f"rlhfjob {name} has no sandbox pods in namespace {ns}" in err

    proc = subprocess.Popen([sys.executable, "-m", "rlhf_launcher.cli", "logs", name, "-n", ns, "--follow"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: line + "\n" in seen, 60, "the log so far")
        later = f"step 8 reward 0.5 {uuid.uuid4().hex}"
        cluster.append_pod_log(later)
        wait_for(lambda: later + "\n" in seen, 30, "a line written after --follow started")
        assert proc.poll() is None  # still following
    finally:
        proc.kill()
        proc.wait()


def test_submit_wait_ends_with_the_runs_exit_code(cluster: Cluster, setup, tmp_path):
    ns, name = setup["ns"], "waited"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job_doc(name)))
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_launcher.cli", "submit", str(tmp_path / "job.yaml"), "-n", ns,
                             "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env)
    try:
        running_pods(cluster, ns, name, 0, count=3)
        cluster.fail_pod(ns, f"{name}-trainer-master-0", exit_code=2, reason="Error", message="bad config")
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 2, err  # the permanent code the pod exited with, as `rlhfctl run` would end
    assert f"{name}: Failed, step 0: trainer pod {name}-trainer-master-0 container pytorch exited with code 2" in err
    cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false")


def test_too_large_working_dir_creates_nothing(cluster: Cluster, setup, tmp_path, capsys):
    ns, name = setup["ns"], "toolarge"
    wd = workdir_job(tmp_path, name)
    (wd / "data" / "big.jsonl").write_text("x" * int(1.5 * MIB))
    code, _, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "--working-dir", str(wd), "-n", ns)
    assert code == 2 and "big.jsonl alone does not fit in one ConfigMap" in err and "1.5 MiB" in err
    time.sleep(1)
    assert cluster.kubectl("get", "rlhfjob", name, "-n", ns, check=False).returncode != 0
    assert not cluster.get("configmaps", namespace=ns, selector=f"rlhf.dev/workdir-of={name}")["items"]


def test_a_refused_job_leaves_no_config_maps(cluster: Cluster, setup, tmp_path, capsys):
    """Someone who may write ConfigMaps but not create RLHFJobs: the API server refuses the job,
    and the ConfigMaps made for it are deleted again. No `-n`: the kubeconfig context's namespace."""
    ns, name = setup["ns"], "refused"
    cluster.kubectl("create", "serviceaccount", "cm-only", "-n", ns)
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "cm-only", "namespace": ns},
                   "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create", "delete", "patch"]},
                             {"apiGroups": ["rlhf.dev"], "resources": ["rlhfjobs"], "verbs": ["get"]}]})
    cluster.kubectl("create", "rolebinding", "cm-only", "-n", ns, "--role=cm-only", f"--serviceaccount={ns}:cm-only")
    config = sa_kubeconfig(cluster, ns, "cm-only", tmp_path / "kubeconfig")
    wd = workdir_job(tmp_path, name)
    code = main(["submit", str(tmp_path / "job.yaml"), "--working-dir", str(wd), "--kubeconfig", str(config)])
    err = capsys.readouterr().err
    assert code == 1 and "forbidden" in err and "rlhfjobs" in err
    assert not cluster.get("configmaps", namespace=ns, selector=f"rlhf.dev/workdir-of={name}")["items"]


class Follower:
    """`rlhfctl ARGS` in its own process (Ctrl-C cannot be sent to a call in this one), its
    stdout lines collected as they come."""

    def __init__(self, cluster: Cluster, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "rlhf_launcher.cli", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=cluster.env)
        self.lines: list[str] = []
        self.errors: list[str] = []
        for pipe, into in ((self.proc.stdout, self.lines), (self.proc.stderr, self.errors)):
            threading.Thread(target=lambda src, dst: dst.extend(line.rstrip("\n") for line in src), args=(pipe, into),
                             daemon=True).start()

    def wait_line(self, wanted, timeout: float, what: str, after: int = 0) -> int:
        """The index of the first line from `after` on that `wanted` (a string or a predicate) matches."""
        match = wanted if callable(wanted) else (lambda line: line == wanted)
        try:
            return wait_for(lambda: next(([i] for i, line in enumerate(self.lines[after:], after) if match(line)),
                                         None), timeout, what)[0]  # [0] is truthy: wait_for polls until truthy
        except TimeoutError as err:
            raise TimeoutError(f"{err}; stdout {self.lines[-10:]}, stderr {self.errors[-10:]}") from None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_logs_of_each_attempt_follow_across_a_restart_previous_and_since(cluster: Cluster, setup, capsys):
    """A restart deletes attempt 0's pods: `-f` prints a separator and goes on with attempt 1's
    pods, and ends with the job; `--attempt 0` then says where attempt 0's trainer log is kept
    on the volume and how to read it; `--previous` and `--since` reach the kubelet (kwok
    serves a previous-instance file and filters by each line's time)."""
    ns, name = setup["ns"], "attempts"
    create(cluster, ns, job_doc(name))
    wait_job(cluster, ns, name, "Running", 0, log=setup["log"])
    running_pods(cluster, ns, name, 0, count=3)
    first = f"attempt 0 says {uuid.uuid4().hex}"
    cluster.append_pod_log(first)
    follower = Follower(cluster, "logs", name, "-n", ns, "-f", "--tail", "1")
    try:
        follower.wait_line(first, 60, "attempt 0's last line")
        cluster.fail_pod(ns, f"{name}-trainer-master-0", exit_code=137, reason="OOMKilled")
        wait_job(cluster, ns, name, "Running", 1, log=setup["log"])
        running_pods(cluster, ns, name, 1, count=3)
        at = follower.wait_line(f"--- attempt 1: {name}-trainer-master-0 ---", 60, "the separator of attempt 1")
        later = f"attempt 1 says {uuid.uuid4().hex}"
        cluster.append_pod_log(later)
        follower.wait_line(later, 30, "attempt 1's new line", after=at)
        assert follower.proc.poll() is None  # still following

        code, out, err = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--attempt", "0")
        assert code == 1 and not out
        assert f"rlhfjob {name} has no trainer pods of attempt 0 now" in err and "--attempt 1" in err
        assert "on the job's volume at /output/logs/attempt-0/<pod>.log" in err
        assert f"kubectl exec -n {ns} {name}-trainer-master-0 -- sh -c 'cat /output/logs/attempt-0/*.log'" in err
        assert f"none found there through pod {name}-trainer-master-0" in err  # kwok runs no exec in this pod
        code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--attempt", "1", "--tail", "1")
        assert code == 0 and out.splitlines() == [later]

        previous = f"the instance before {uuid.uuid4().hex}"
        cluster.append_pod_log(previous, previous=True)
        code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "-p", "--tail", "1")
        assert code == 0 and out.splitlines() == [previous]

        old = f"two hours ago {uuid.uuid4().hex}"
        cluster.append_pod_log(old, at=datetime.now(timezone.utc) - timedelta(hours=2))
        code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--since", "1h")
        assert code == 0 and later in out.splitlines() and old not in out
        code, out, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--since", "2h30m")
        assert code == 0 and out.splitlines()[-1] == old

        cluster.complete_pod(ns, f"{name}-trainer-master-0")  # the job ends: so does the follow
        wait_job(cluster, ns, name, "Succeeded", log=setup["log"])
        assert follower.proc.wait(timeout=30) == 0, follower.proc.stderr.read()
    finally:
        follower.stop()
    cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false")


def test_logs_of_the_fetch_step(cluster: Cluster, setup, capsys):
    """`--role fetch`: the `fetch` init container of the trainer and rollout pods of a job
    whose model is on the Hub; a job without sources has none to show."""
    ns, name = setup["ns"], "fetched"
    create(cluster, ns, job_doc(name, model={"path": "hf://org/tiny"}))
    running_pods(cluster, ns, name, 0, count=3)
    line = f"downloaded hf://org/tiny {uuid.uuid4().hex}"
    cluster.append_pod_log(line)
    code, out, err = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--role", "fetch", "--tail", "1")
    assert code == 0, err
    assert out.splitlines() == [f"[{name}-{pod}] {line}" for pod in ("rollout-0", "rollout-1", "trainer-master-0")]
    cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false")


def test_generate_name_get_selector_and_watch_delete_several(cluster: Cluster, setup, tmp_path, capsys):
    """`metadata.generateName`: the server names the job and submit prints it; `get -l` picks
    by label; `get -w NAME` prints a row per change and ends with the job; `delete a b c`
    deletes each, says which were not found, and `--ignore-not-found` is quiet about them."""
    ns = setup["ns"]
    doc = job_doc("unused")
    doc["metadata"] = {"generateName": "gen-", "labels": {"team": "a"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    code, out, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "-n", ns)
    assert code == 0, err
    created = re.fullmatch(rf"rlhfjob/(gen-[bcdfghjklmnpqrstvwxz2456789]{{5}}) created in namespace {ns}\n", out)
    assert created, out
    name = created.group(1)
    other = job_doc("other")
    other["metadata"]["labels"] = {"team": "b"}
    create(cluster, ns, other)

    code, out, _ = rlhfctl(cluster, capsys, "get", "-n", ns, "-l", "team=a")
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [name]
    code, out, _ = rlhfctl(cluster, capsys, "get", "-n", ns, "-l", "team in (a,b)", "-o", "json")
    assert sorted(j["metadata"]["name"] for j in json.loads(out)["items"]) == sorted([name, "other"])
    code, _, err = rlhfctl(cluster, capsys, "get", name, "-n", ns, "-l", "team=a")
    assert code == 2 and "drop one of them" in err

    running_pods(cluster, ns, name, 0, count=3)
    objects = Follower(cluster, "get", "-n", ns, "-l", "team=b", "-w", "-o", "json")  # every change, whole
    watcher = Follower(cluster, "get", name, "-n", ns, "-w")
    try:
        watcher.wait_line(lambda line: line.split() == ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"], 30,
                          "the header")
        watcher.wait_line(lambda line: line.split()[:2] == [name, "Running"], 30, "the row of the running job")
        cluster.complete_pod(ns, f"{name}-trainer-master-0")
        watcher.wait_line(lambda line: line.split()[:2] == [name, "Succeeded"], 60, "the row of the ended job")
        assert watcher.proc.wait(timeout=30) == 0
        objects.wait_line("}", 30, "the job labelled team=b as one JSON object")
        first = json.loads("\n".join(objects.lines[:objects.lines.index("}") + 1]))
        assert first["metadata"]["name"] == "other" and first["kind"] == "RLHFJob"
        assert objects.proc.poll() is None  # no name: until Ctrl-C
    finally:
        watcher.stop()
        objects.stop()

    code, out, err = rlhfctl(cluster, capsys, "delete", name, "missing", "other", "-n", ns)
    assert code == 1 and f"rlhfjob missing not found in namespace {ns}" in err
    assert [line.split()[0] for line in out.splitlines()] == [f"rlhfjob/{name}", "rlhfjob/other"]
    code, out, err = rlhfctl(cluster, capsys, "delete", "missing", "-n", ns, "--ignore-not-found")
    assert (code, out, err) == (0, "", "")


def test_an_earlier_attempts_trainer_log_is_read_from_the_volume_through_a_running_pod(cluster: Cluster, setup,
                                                                                       tmp_path, capsys):
    """Attempt 0's pods are gone; what its trainer pod kept on the volume
    (`<output.dir>/logs/attempt-0/<pod>.log`, rlhf_trainer.podlog) is read through attempt 1's
    running trainer pod by `kubectl exec` (`ls`, `cat`). kwok runs that exec on this host for
    a pod named EXEC_POD, so the job's output dir is a host directory here."""
    ns, name, out = setup["ns"], EXEC_POD.removesuffix("-trainer-master-0"), tmp_path / "out"
    doc = job_doc(name, output={"dir": str(out)})
    doc["spec"]["pod"]["volumeMounts"].append({"name": "work", "mountPath": str(out), "subPath": "out"})
    create(cluster, ns, doc)
    running_pods(cluster, ns, name, 0, count=3)
    kept = Path(trainer_log_path(str(out), 0, EXEC_POD))
    kept.parent.mkdir(parents=True)
    kept.write_text("step 1 reward 0.1\nstep 2 reward 0.2\nTraceback: CUDA out of memory\n")
    cluster.fail_pod(ns, EXEC_POD, exit_code=137, reason="OOMKilled")
    wait_job(cluster, ns, name, "Running", 1, log=setup["log"])
    running_pods(cluster, ns, name, 1, count=3)

    code, text, err = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--attempt", "0")
    assert code == 0, err
    assert text == kept.read_text()
    code, text, _ = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--attempt", "0", "--tail", "1")
    assert code == 0 and text == "Traceback: CUDA out of memory\n"
    code, text, err = rlhfctl(cluster, capsys, "logs", name, "-n", ns, "--attempt", "5")
    assert code == 1 and not text and f"on the job's volume at {out}/logs/attempt-5/<pod>.log" in err
    assert f"none found there through pod {EXEC_POD}" in err
    cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false")


def served_backends(cluster: Cluster) -> dict[str, bool]:
    """What the cluster has, read from its CRDs (kubectl), for the tests below to compare."""
    crds = {c["metadata"]["name"] for c in cluster.get("crd")["items"]}
    return {"PyTorchJob": "pytorchjobs.kubeflow.org" in crds, "JobSet": "jobsets.jobset.x-k8s.io" in crds,
            "TrainJob": "trainjobs.trainer.kubeflow.org" in crds,
            "Kueue": any(c.endswith(".kueue.x-k8s.io") for c in crds)}


def test_env_lists_the_backends_the_cluster_has(cluster: Cluster, capsys):
    code, out, _ = rlhfctl(cluster, capsys, "env", "-o", "json")
    assert code == 0
    have = served_backends(cluster)
    assert have["PyTorchJob"] and have["JobSet"]  # the test cluster runs both controllers
    assert json.loads(out)["cluster"]["backends"] == {k: "installed" if v else "not installed" for k, v in have.items()}


def test_submit_refuses_a_job_whose_backend_the_cluster_lacks(cluster: Cluster, setup, tmp_path, capsys):
    if served_backends(cluster)["TrainJob"]:
        pytest.skip("Kubeflow Trainer's CRDs are installed on this cluster (an earlier test)")
    ns = setup["ns"]
    doc = job_doc("nobackend", backend="TrainJob")
    doc["spec"]["pod"]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    doc["spec"].update(model={"path": "/work/models/tiny"}, data={"path": "/work/data/train.jsonl"},
                       output={"dir": "/work/output"})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    code, _, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "-n", ns)
    assert code == 2
    assert "spec.backend TrainJob: the cluster has no trainjobs.trainer.kubeflow.org CRD; install Kubeflow Trainer" in err
    assert cluster.kubectl("get", "rlhfjob", "nobackend", "-n", ns, check=False).returncode != 0
    # the same job as a JobSet (the cluster has it) goes through
    doc["spec"]["backend"] = "JobSet"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    code, out, err = rlhfctl(cluster, capsys, "submit", str(tmp_path / "job.yaml"), "-n", ns)
    assert code == 0, err
    cluster.kubectl("delete", "rlhfjob", "nobackend", "-n", ns, "--wait=false")
