"""Pods that really run: our four images, built from their own Dockerfiles without a Docker
engine (`make test-images`: hack/images.py on BuildKit, bases from Debian's archive and
PyPI), pulled by a real node (containerd + runc + CNI, kubelet and kube-proxy from the
control plane's module, CoreDNS) from the suite's registry. Nothing here starts a trainer or
a rollout server itself: the chart is installed from the registry as an OCI artifact, its
operator runs as the Deployment's pod and leader-elects, and `rlhfctl submit` sends a CPU
job whose pods the operator and the training-operator create.

One module, one job, in order (each test needs the state the one before left):
  images  - vLLM's own CLI runs in the rollout image's base (`vllm serve --help`)
  chart   - `helm install oci://` of the packaged chart; the operator's pod leader-elects
  job     - the job's pods run; STEP and REWARD move in `kubectl get rlj`; Prometheus scrapes
            the trainer pod; deleting the trainer pod restarts the whole job, which resumes
            from its newest checkpoint on the PersistentVolume; the reward rises;
            `rlhfctl logs` shows the trainer's log; `rlhfctl delete` removes every child and
            the checkpoints stay.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_contract import images

from .harness import Cluster, wait_for
from .realnode import NODE_NAME, SELECTOR, STATE, TOLERATION, RealNode
from .registry import Registry, node_tools

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.realnode]

ROOT = Path(__file__).resolve().parents[2]
LOCK = Path.home() / ".cache" / "rlhf-operator" / "test-images.lock.json"
CHART = ROOT / "charts" / "rlhf-operator"
JOB = "pods-grpo"
STEPS = 100


def _lock() -> dict:
    if not LOCK.exists():
        pytest.skip(f"{LOCK} missing: `make test-images` builds the images these tests run")
    return json.loads(LOCK.read_text())


@pytest.fixture(scope="module")
def stack(cluster: Cluster, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a real node needs root (containerd, runc, iptables)")
    lock = _lock()
    work = tmp_path_factory.mktemp("real-pods")
    tools = node_tools()
    registry = Registry.start(work, tools, shared=True)
    if registry.host != lock["registry"]:
        registry.stop()
        pytest.skip(f"the test images' registry {lock['registry']} is not free to serve them (another session?)")
    node = None
    ns = f"real-{uuid.uuid4().hex[:6]}"
    try:
        missing = [e["ref"] for e in lock["images"].values()
                   if registry.digest(*e["image"].split("/", 1)[1].rsplit(":", 1)) != e["digest"]]
        assert not missing, f"images of {LOCK} not in the registry: {missing}; run `make test-images`"
        node = RealNode(cluster, tools, registry.host, lock["pause"]).start()
        node.keep_only_images({e["digest"] for e in lock["images"].values()} | {lock["pause"].rsplit("@", 1)[1]})
        cluster.kubectl("create", "namespace", ns)
        yield {"lock": lock, "registry": registry, "node": node, "ns": ns, "work": work,
               "ref": {n: e["ref"] for n, e in lock["images"].items()}}
    finally:
        if node is not None:
            cluster.helm("uninstall", "rlhf", "-n", f"{ns}-system", "--wait", "--timeout", "60s", check=False)
            cluster.kubectl("delete", "namespace", ns, f"{ns}-system", "--wait=false", "--ignore-not-found", check=False)
            node.stop()
        registry.stop()


def pod_on_node(cluster: Cluster, ns: str, name: str, image: str, command: list[str]) -> dict:
    cluster.apply({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
        "spec": {"restartPolicy": "Never", "nodeSelector": SELECTOR, "tolerations": [TOLERATION],
                 "containers": [{"name": "main", "image": image, "command": command,
                                 "env": [{"name": "HOME", "value": "/tmp"}],  # the image's uid has no home
                                 "imagePullPolicy": "IfNotPresent"}]},
    })
    pod = wait_for(lambda: (p := cluster.get("pod", name, namespace=ns))["status"].get("phase") in ("Succeeded", "Failed")
                   and p, 600, f"pod {name} to finish")
    return pod


VLLM_PROBE = """
import subprocess, vllm
print("VLLM_VERSION", vllm.__version__)
r = subprocess.run(["vllm", "serve", "--help"], capture_output=True, text=True)
print("SERVE_HELP_RC", r.returncode)
print(r.stdout[-4000:])
print(r.stderr[-4000:])
"""


def test_vllm_cli_runs_in_the_rollout_image(cluster: Cluster, stack):
    """The rollout image's base is PyPI's vLLM wheel (the pinned release, a CUDA build) on
    Debian: it imports in a container on the real node, and its CLI runs as far as a machine
    without a GPU lets it. `vllm serve --help` builds the engine's defaults, and a CUDA build
    on a GPU-less machine stops there ("Failed to infer device type"): with a GPU the same
    command prints the help; here that exact refusal is what is expected."""
    pod = pod_on_node(cluster, stack["ns"], "vllm-cli", stack["ref"]["inference"], ["python", "-c", VLLM_PROBE])
    logs = cluster.kubectl("logs", "vllm-cli", "-n", stack["ns"], check=False).stdout
    assert pod["status"]["phase"] == "Succeeded", logs[-3000:] + "\n" + stack["node"].report([stack["ns"]])
    assert pod["spec"]["nodeName"] == NODE_NAME
    assert f"VLLM_VERSION {images.VLLM_VERSION}" in logs
    helped = "SERVE_HELP_RC 0" in logs and "--tensor-parallel-size" in logs
    no_gpu = "Failed to infer device type" in logs and "vllm/config/device.py" in logs
    assert helped or no_gpu, logs[-3000:]


def test_helm_install_from_the_registry_and_the_operator_pod_leads(cluster: Cluster, stack):
    """`make release` (hack/release.sh) against the suite's registry: the chart packaged with
    the operator image pinned by tag and digest, pushed as an OCI artifact; then a team's
    `helm install oci://...` of it, whose operator pod pulls that digest and leads."""
    reg, ns = stack["registry"], stack["ns"]
    release_ns = f"{ns}-system"
    op = stack["lock"]["images"]["operator"]
    lock = stack["work"] / "images.lock.json"
    lock.write_text(json.dumps({n: {"image": e["image"], "digest": e["digest"]} for n, e in stack["lock"]["images"].items()}))
    out = subprocess.run(["bash", str(ROOT / "hack" / "release.sh")], capture_output=True, text=True, timeout=600,
                         cwd=stack["work"], env={**os.environ, "REGISTRY": f"{reg.host}/rlhf-operator", "PLAIN_HTTP": "1",
                                                 "IMAGES_LOCK": str(lock), "HELM": cluster.bin("helm"),
                                                 "DIST": str(stack["work"] / "dist")})
    assert out.returncode == 0, out.stdout + out.stderr
    assert reg.digest("rlhf-operator/charts/rlhf-operator", images.VERSION)  # an OCI artifact in the registry
    values = {"watchNamespaces": [ns], "nodeSelector": SELECTOR, "tolerations": [TOLERATION],
              "resyncSeconds": 5, "helmTest": {"enabled": False}}
    (stack["work"] / "values.yaml").write_text(yaml.safe_dump(values))
    out = cluster.helm("install", "rlhf", f"oci://{reg.host}/rlhf-operator/charts/rlhf-operator",
                       "--version", images.VERSION, "--plain-http", "--namespace", release_ns, "--create-namespace",
                       "-f", str(stack["work"] / "values.yaml"), "--take-ownership", "--wait", "--timeout", "5m",
                       check=False, timeout=420)
    assert out.returncode == 0, out.stdout + out.stderr + stack["node"].report([release_ns])
    stack["release_ns"] = release_ns
    pods = cluster.get("pods", namespace=release_ns)["items"]
    assert len(pods) == 1 and pods[0]["spec"]["nodeName"] == NODE_NAME
    assert pods[0]["spec"]["containers"][0]["image"] == f"{op['image']}@{op['digest']}"  # by tag and digest
    status = pods[0]["status"]["containerStatuses"][0]
    assert status["ready"] and status["imageID"].endswith(op["digest"])  # that digest pulled, and running
    # it leads: the Lease names its pod
    leases = wait_for(lambda: [le for le in cluster.get("leases", namespace=release_ns)["items"]
                               if le["spec"].get("holderIdentity", "").startswith(pods[0]["metadata"]["name"])],
                      60, "the operator pod to hold the leader Lease")
    assert leases


def _job_doc(stack, claim: str) -> dict:
    ref = stack["ref"]
    return {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": JOB},
        "spec": {
            "pod": {"nodeSelector": SELECTOR, "tolerations": [TOLERATION]},
            # fetched by the pods' own init step from the suite's Hub server and S3 server
            "model": {"path": "hf://real/tiny@v1"},
            "data": {"path": "s3://real-data/lastdigit/train.jsonl", "maxPromptLength": 16},
            "storageSecret": "storage",
            "reward": {"type": "exact_match"},
            "algorithm": {"preset": "grpo", "lossAgg": "token-mean", "klCoef": 0.0},
            "rollout": {"engine": "cpu", "image": ref["inference"], "replicas": 2, "samplesPerPrompt": 8,
                        "maxTokens": 1, "temperature": 1.0,
                        "resources": {"requests": {"cpu": "100m", "memory": "2Gi"}}},
            "trainer": {"image": ref["trainer"], "device": "cpu", "nprocPerNode": 1, "learningRate": 0.001,
                        "resources": {"requests": {"cpu": "100m", "memory": "4Gi"}}},
            "schedule": {"totalSteps": STEPS, "promptsPerStep": 16, "saveEvery": 20, "seed": 0},
            "output": {"claimName": claim},
            "runPolicy": {"maxRestarts": 2},
        },
    }


def rlhfctl(cluster: Cluster, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", *args, "--kubeconfig", str(cluster.kubeconfig)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def get_rlj(cluster: Cluster, ns: str) -> dict:
    """`kubectl get rlj` as a user reads it: the printer columns by name."""
    out = cluster.kubectl("get", "rlj", JOB, "-n", ns).stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    return dict(zip(header, row))


@pytest.fixture
def remote_sources(cluster: Cluster, stack, tiny_model_dir, tmp_path_factory):
    """The suite's Hub server (olah) and S3 server (versitygw) on the host's address (pods
    cannot reach its loopback), holding the built-in model and the demo's prompts, and the
    job's storage Secret naming them."""
    from storage_servers import HubServer, S3Server

    hub = HubServer(tmp_path_factory.mktemp("hub"), host=cluster.host_ip)
    s3 = S3Server(tmp_path_factory.mktemp("s3"), host=cluster.host_ip)
    try:
        hub.add_repo("real/tiny", tiny_model_dir, tag="v1")
        data = tmp_path_factory.mktemp("data")
        (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{n}:", "answer": str(n)[-1]}) + "\n"
                                                  for n in range(1000, 2000)))
        s3.put_dir("real-data", "lastdigit", data)
        cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "storage", "namespace": stack["ns"]},
                       "stringData": {**s3.env(), "HF_ENDPOINT": hub.endpoint}})
        yield {"hub": hub, "s3": s3}
    finally:
        hub.stop()
        s3.kill()


def test_a_cpu_job_runs_in_real_pods_restarts_whole_and_learns(cluster: Cluster, stack, remote_sources, tmp_path):
    if "release_ns" not in stack:
        pytest.skip("the operator was not installed (test_helm_install... failed)")
    ns = stack["ns"]
    # A PersistentVolume on the node (hostPath) for the output: checkpoints survive restarts and the job.
    pv_dir = STATE / "pv" / ns
    pv_dir.mkdir(parents=True, exist_ok=True)
    os.chown(pv_dir, 1000, 1000)  # the pods' uid (a hostPath volume gets no fsGroup)
    claim = "pods-grpo-output"
    cluster.apply(
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-output"},
         "spec": {"capacity": {"storage": "5Gi"}, "accessModes": ["ReadWriteOnce"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "real-node-local",
                  "hostPath": {"path": str(pv_dir), "type": "Directory"},
                  "claimRef": {"namespace": ns, "name": claim}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": ns},
         "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "real-node-local",
                  "resources": {"requests": {"storage": "5Gi"}}}},
    )
    prom = Prometheus.start(cluster, ns, tmp_path)
    try:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(_job_doc(stack, claim)))
        out = rlhfctl(cluster, "submit", str(tmp_path / "job.yaml"), "-n", ns)
        assert out.returncode == 0, out.stdout + out.stderr

        def progressed(min_step: int):
            row = get_rlj(cluster, ns)
            return row if row.get("STEP", "").isdigit() and int(row["STEP"]) >= min_step else None

        try:
            first = wait_for(lambda: progressed(1), 600, "the job's first step in `kubectl get rlj`", interval=2)
        except TimeoutError:
            raise AssertionError(cluster.kubectl("get", "rlj,pods,events", "-n", ns, "-o", "wide").stdout
                                 + rlhfctl(cluster, "logs", JOB, "-n", ns, "--tail", "60").stdout
                                 + stack["node"].report([ns]))
        assert int(first["STEP"]) >= 1
        wait_for(lambda: get_rlj(cluster, ns)["PHASE"] == "Running", 120, "PHASE Running", interval=2)
        pods = cluster.get("pods", namespace=ns, selector=f"rlhf.dev/job={JOB}")["items"]
        assert pods and all(p["spec"]["nodeName"] == NODE_NAME for p in pods)  # real containers, not kwok's
        roles = sorted(p["metadata"]["labels"].get("rlhf.dev/role") for p in pods)
        assert roles == ["rollout", "rollout", "trainer"], roles
        for p in pods:  # the init steps (the trainer's fetches hf:// and s3://) ended well
            inits = p["status"].get("initContainerStatuses", [])
            assert all(i["state"].get("terminated", {}).get("exitCode") == 0 for i in inits), inits
            if p["metadata"]["labels"].get("rlhf.dev/role") == "trainer":
                assert inits, "the trainer pod has no fetch step"

        # Prometheus (the real one) scrapes rank 0 at its pod IP (the pods a PodMonitor selects)
        scraped = wait_for(lambda: prom.value("max(rlhf_step)"), 120, "Prometheus to scrape rlhf_step", interval=2)
        assert scraped >= 1

        # Delete the trainer pod after a checkpoint: the WHOLE job restarts and resumes from it.
        ckpt = wait_for(lambda: cluster.get("rlj", JOB, namespace=ns)["status"].get("progress", {}).get("lastCheckpoint"),
                        600, "a first checkpoint", interval=2)
        saved_step = int(ckpt.rstrip("/").rsplit("-", 1)[1])
        trainer = next(p for p in pods if p["metadata"]["labels"].get("rlhf.dev/role") == "trainer")
        old_uids = {p["metadata"]["uid"] for p in pods}
        cluster.kubectl("delete", "pod", trainer["metadata"]["name"], "-n", ns, "--wait=false")
        wait_for(lambda: cluster.get("rlj", JOB, namespace=ns)["status"].get("restarts", 0)
                 + cluster.get("rlj", JOB, namespace=ns)["status"].get("disruptions", 0) >= 1,
                 300, "the job to count the restart", interval=2)
        done = wait_for(lambda: (s := cluster.get("rlj", JOB, namespace=ns)["status"]).get("phase") in ("Succeeded", "Failed")
                        and s, 1500, "the job to finish", interval=5)
        assert done["phase"] == "Succeeded", (done, stack["node"].report([ns]))
        new_pods = cluster.get("pods", namespace=ns, selector=f"rlhf.dev/job={JOB}")["items"]
        assert not old_uids & {p["metadata"]["uid"] for p in new_pods}  # every pod replaced, rollout servers too

        logs = rlhfctl(cluster, "logs", JOB, "-n", ns)
        assert logs.returncode == 0, logs.stderr
        resumed = re.search(r"resumed from (\S+) \(step (\d+)\)", logs.stdout)  # the second attempt's trainer
        assert resumed, (logs.stdout[:3000], logs.stderr[-2000:])
        assert saved_step <= int(resumed.group(2)) < STEPS  # from the checkpoint on the volume, not from scratch

        assert list(pv_dir.glob("**/hf/models/real/tiny/**/config.json")), "the Hub model is not on the volume"
        rows = [json.loads(line) for line in (pv_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once, across both attempts
        rewards = [r["reward_mean"] for r in rows]
        first10, last10 = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        assert last10 >= 0.4 and last10 >= 2 * first10, (first10, last10)
        print(f"real pods: reward {first10:.2f} (first 10 steps) -> {last10:.2f} (last 10); saved step {saved_step}, "
              f"resumed at step {resumed.group(2)}")
        assert float(get_rlj(cluster, ns)["REWARD"]) == pytest.approx(done["progress"]["rewardMean"], abs=1e-3)

        # `rlhfctl delete`: every child gone, the checkpoints kept on the volume
        out = rlhfctl(cluster, "delete", JOB, "-n", ns)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_for(lambda: not cluster.kubectl("get", "pytorchjobs,statefulsets,services,configmaps,pods,serviceaccounts,roles,networkpolicies",
                                             "-n", ns, "-l", f"rlhf.dev/job={JOB}", "-o", "name").stdout.strip(),
                 120, "every child of the job gone")
        assert sorted(p.name for p in (pv_dir / "checkpoints").iterdir() if p.name.startswith("step-"))
    finally:
        prom.stop()
        cluster.kubectl("delete", "pv", f"{ns}-output", "--wait=false", check=False)
        shutil.rmtree(pv_dir, ignore_errors=True)  # the volume's data on the host, kept until here


class Prometheus:
    """The real Prometheus (Debian's, `make prometheus-tools`) scraping the job's pods at their
    pod IPs over the node's pod network. Debian builds it without Kubernetes discovery, so
    `discover()` plays that part: it lists the pods with a container port named `metrics`
    (what the chart's PodMonitor selects) through the API and writes them as file-discovery
    targets."""

    def __init__(self, proc, port, targets: Path):
        self.proc, self.port, self.targets = proc, port, targets

    @classmethod
    def start(cls, cluster: Cluster, ns: str, tmp_path: Path) -> "Prometheus":
        bin_dir = os.environ.get("RLHF_PROMETHEUS_BIN") or next(
            iter(sorted(Path.home().glob(".cache/rlhf-operator/prometheus-*/usr/bin"))), None)
        if not bin_dir or not (Path(bin_dir) / "prometheus").exists():
            pytest.skip("prometheus is not unpacked: `make prometheus-tools`")
        from .procs import free_port

        port = free_port()
        targets = tmp_path / "targets.json"
        targets.write_text("[]")
        config = {
            "global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
            "scrape_configs": [{"job_name": "rlhf-trainers",
                                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen([str(Path(bin_dir) / "prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        p = cls(proc, port, targets)
        try:
            wait_for(lambda: p._get("/-/ready") is not None, 60, "prometheus ready")
        except TimeoutError:
            p.stop()
            raise AssertionError((tmp_path / "prometheus.log").read_text()[-2000:])
        p.cluster, p.ns = cluster, ns
        return p

    def discover(self) -> int:
        found = []
        for pod in self.cluster.get("pods", namespace=self.ns)["items"]:
            ip = pod["status"].get("podIP")
            for c in pod["spec"]["containers"]:
                for port in c.get("ports", []):
                    if port.get("name") == "metrics" and ip:
                        found.append({"targets": [f"{ip}:{port['containerPort']}"],
                                      "labels": {"pod": pod["metadata"]["name"]}})
        self.targets.write_text(json.dumps(found))
        return len(found)

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read()
        except OSError:
            return None

    def value(self, query: str) -> float | None:
        self.discover()
        body = self._get("/api/v1/query?query=" + urllib.parse.quote(query))
        result = json.loads(body)["data"]["result"] if body else []
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
