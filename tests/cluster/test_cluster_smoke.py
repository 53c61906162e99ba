"""Smoke tests of the real control plane: the things the operator's cluster tests rely on."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from .harness import GPU_RESOURCE, Cluster, wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def ns(cluster: Cluster):
    """A fresh namespace (with its default service account) per test."""
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
             30, "default service account")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def pods(cluster: Cluster, ns: str, selector: str | None = None) -> list[dict]:
    return cluster.get("pods", namespace=ns, selector=selector)["items"]


def plain_pod(name: str, gpus: int = 0) -> dict:
    resources = {"limits": {GPU_RESOURCE: str(gpus)}} if gpus else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "main", "image": "busybox", "resources": resources}]}}


def wait_phase(cluster: Cluster, ns: str, name: str, phase: str, timeout: float = 60) -> dict:
    def done():
        p = cluster.get("pod", name, namespace=ns)
        return p if p.get("status", {}).get("phase") == phase else None
    return wait_for(done, timeout, f"pod {ns}/{name} {phase}")


def test_server_version_and_nodes_report_gpus(cluster: Cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.34.")
    assert version["clientVersion"]["gitVersion"].startswith("v1.34.")
    nodes = cluster.get("nodes")["items"]
    assert len(nodes) >= 1
    for n in nodes:
        assert n["status"]["capacity"][GPU_RESOURCE] == "8"
        assert n["status"]["allocatable"][GPU_RESOURCE] == "8"
        ready = {c["type"]: c["status"] for c in n["status"]["conditions"]}["Ready"]
        assert ready == "True", n["metadata"]["name"]


def test_pytorchjob_gets_pods_and_services_on_gpu_nodes(cluster: Cluster, ns: str):
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "smoke", "namespace": ns},
        "spec": {"pytorchReplicaSpecs": {
            role: {"replicas": replicas, "restartPolicy": "Never", "template": {"spec": {"containers": [{
                "name": "pytorch", "image": "example.invalid/trainer:latest",
                "command": ["torchrun", "train.py"],
                "resources": {"limits": {GPU_RESOURCE: "8"}}}]}}}
            for role, replicas in (("Master", 1), ("Worker", 2))}},
    }
    proc = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
    assert "created" in proc.stdout

    def running():
        ps = pods(cluster, ns, "training.kubeflow.org/job-name=smoke")
        return ps if len(ps) == 3 and all(p["status"].get("phase") == "Running" for p in ps) else None
    ps = wait_for(running, 90, "3 PyTorchJob pods Running")
    node_names = {n["metadata"]["name"]: n for n in cluster.get("nodes")["items"]}
    assigned = [p["spec"]["nodeName"] for p in ps]
    assert len(set(assigned)) == 3, "8 GPUs per pod: one pod per node"
    for name in assigned:
        assert node_names[name]["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    roles = sorted(p["metadata"]["labels"]["training.kubeflow.org/replica-type"] for p in ps)
    assert roles == ["master", "worker", "worker"]
    master = next(p for p in ps if p["metadata"]["labels"]["training.kubeflow.org/replica-type"] == "master")
    env = {e["name"]: e.get("value") for e in master["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "3" and env["RANK"] == "0" and "MASTER_ADDR" in env

    services = cluster.get("services", namespace=ns, selector="training.kubeflow.org/job-name=smoke")["items"]
    assert len(services) == 3
    assert all(s["spec"]["clusterIP"] == "None" for s in services)

    def job_running():
        st = cluster.get("pytorchjob", "smoke", namespace=ns).get("status", {})
        return any(c["type"] == "Running" and c["status"] == "True" for c in st.get("conditions", []))
    wait_for(job_running, 60, "PyTorchJob Running condition")

    # Completing the master (the torchrun job's success policy) makes the job Succeeded.
    cluster.complete_pod(ns, master["metadata"]["name"])

    def job_succeeded():
        st = cluster.get("pytorchjob", "smoke", namespace=ns).get("status", {})
        return any(c["type"] == "Succeeded" and c["status"] == "True" for c in st.get("conditions", []))
    wait_for(job_succeeded, 60, "PyTorchJob Succeeded condition")


def test_pytorchjob_webhook_rejects_bad_spec(cluster: Cluster, ns: str):
    bad = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
           "metadata": {"name": "bad", "namespace": ns},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 2, "template": {"spec": {
               "containers": [{"name": "pytorch", "image": "x"}]}}}}}}
    proc = cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    assert "admission webhook" in proc.stderr and "denied" in proc.stderr


def test_statefulset_gets_pods_and_gc_removes_them(cluster: Cluster, ns: str):
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "rollout", "namespace": ns},
           "spec": {"serviceName": "rollout", "replicas": 2, "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": {"app": "rollout"}},
                    "template": {"metadata": {"labels": {"app": "rollout"}}, "spec": {"containers": [{
                        "name": "vllm", "image": "example.invalid/vllm:latest",
                        "resources": {"limits": {GPU_RESOURCE: "1"}}}]}}}}
    cluster.apply(sts)

    def running():
        ps = pods(cluster, ns, "app=rollout")
        return ps if len(ps) == 2 and all(p["status"].get("phase") == "Running" for p in ps) else None
    ps = wait_for(running, 60, "StatefulSet pods Running")
    assert sorted(p["metadata"]["name"] for p in ps) == ["rollout-0", "rollout-1"]
    assert all(p["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet" for p in ps)

    # Background cascading delete: the garbage collector removes the pods.
    cluster.kubectl("delete", "statefulset", "rollout", "-n", ns, "--cascade=background")
    wait_for(lambda: not pods(cluster, ns, "app=rollout"), 60, "StatefulSet pods garbage-collected")


def test_deleting_owner_garbage_collects_children(cluster: Cluster, ns: str):
    cluster.kubectl("create", "configmap", "owner", "-n", ns)
    uid = cluster.get("configmap", "owner", namespace=ns)["metadata"]["uid"]
    children = [{"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": f"child-{i}", "namespace": ns, "ownerReferences": [
                     {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]}}
                for i in range(3)]
    children.append({"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": "child-svc", "namespace": ns, "ownerReferences": [
                         {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}]},
                     "spec": {"clusterIP": "None", "selector": {"app": "x"}, "ports": [{"port": 29500}]}})
    cluster.apply(*children)
    cluster.kubectl("delete", "configmap", "owner", "-n", ns)

    def gone():
        left = cluster.kubectl("get", "configmap,service", "-n", ns, "-o", "name").stdout.split()
        return not any("child" in x for x in left)
    wait_for(gone, 60, "children garbage-collected")


def test_chaos_fail_and_complete_pods(cluster: Cluster, ns: str):
    cluster.apply(*[{**plain_pod(n, gpus=1), "metadata": {"name": n, "namespace": ns}}
                    for n in ("will-fail", "will-succeed")])
    wait_phase(cluster, ns, "will-fail", "Running")
    wait_phase(cluster, ns, "will-succeed", "Running")

    cluster.fail_pod(ns, "will-fail", exit_code=137, reason="OOMKilled")
    pod = wait_phase(cluster, ns, "will-fail", "Failed")
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 137 and term["reason"] == "OOMKilled"

    cluster.complete_pod(ns, "will-succeed")
    pod = wait_phase(cluster, ns, "will-succeed", "Succeeded")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_chaos_node_not_ready_and_back(cluster: Cluster):
    (name,) = cluster.create_nodes(1, prefix="chaos-node")
    try:
        cluster.wait_nodes_ready([name], timeout=30)
        cluster.set_node_ready(name, False)
        wait_for(lambda: not cluster.node_ready(name), 30, f"{name} NotReady")
        # The node lifecycle controller reacts like on a real cluster: not-ready taint.
        wait_for(lambda: any(t["key"] == "node.kubernetes.io/not-ready"
                             for t in cluster.get("node", name)["spec"].get("taints", [])),
                 60, "not-ready taint")
        cluster.set_node_ready(name, True)
        wait_for(lambda: cluster.node_ready(name), 30, f"{name} Ready again")
    finally:
        cluster.kubectl("delete", "node", name, "--wait=false", check=False)


def test_helm_version_and_template(cluster: Cluster, tmp_path):
    out = cluster.helm("version", "--short").stdout
    assert out.startswith("v3.")
    chart = tmp_path / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("replicas: 2\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cfg\n"
        "data:\n  replicas: {{ .Values.replicas | quote }}\n")
    rendered = cluster.helm("template", "smoke", str(chart), "--set", "replicas=3").stdout
    cm = yaml.safe_load(rendered)
    assert cm["metadata"]["name"] == "smoke-cfg" and cm["data"]["replicas"] == "3"
    # And the rendered manifest is accepted by the real API server.
    proc = subprocess.run([cluster.bin("kubectl"), "apply", "--dry-run=server", "-n", "default", "-f", "-"],
                          input=rendered, capture_output=True, text=True, env=cluster.env)
    assert proc.returncode == 0, proc.stderr


def test_python_client_uses_the_kubeconfig(cluster: Cluster):
    from kubernetes import client

    with cluster.api_client() as api:
        nodes = client.CoreV1Api(api).list_node().items
        assert all(n.status.capacity[GPU_RESOURCE] == "8" for n in nodes)
        crd = client.ApiextensionsV1Api(api).read_custom_resource_definition("pytorchjobs.kubeflow.org")
        assert crd.spec.group == "kubeflow.org"
