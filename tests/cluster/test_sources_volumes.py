"""Where a job's downloads land, on the real control plane: the operator (a subprocess) reads
the output claim's accessModes from the API server and, for a ReadWriteMany claim, gives the
rollout pods that claim (read-only in the server, writable in the download step) and, with
`spec.sourceCache`, the cache claim; the API server and the StatefulSet controller accept
the pods (the claims stay unbound: no provisioner runs here, and none is needed to read them)."""

from __future__ import annotations

import pytest

from rlhf_contract.sources import SOURCE_CACHE_DIR

from .harness import Cluster, wait_for
from .test_operator import create, job_doc, operator_in_namespace

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def setup(cluster: Cluster, tmp_path_factory):
    with operator_in_namespace(cluster, tmp_path_factory, "src") as s:
        yield s


def claim(cluster: Cluster, ns: str, name: str, mode: str) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": ns},
                   "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}})


def rollout_pod(cluster: Cluster, ns: str, name: str) -> dict:
    """The rollout StatefulSet's pod template, once the operator made it."""
    def made():
        found = cluster.get("statefulsets", namespace=ns, selector=f"rlhf.dev/job={name}")["items"]
        return next((s["spec"]["template"]["spec"] for s in found if s["metadata"]["name"] == f"{name}-rollout"), None)
    return wait_for(made, 60, f"{name}-rollout")


def mounts(container: dict) -> dict[str, tuple[str, bool]]:
    return {m["name"]: (m["mountPath"], bool(m.get("readOnly"))) for m in container.get("volumeMounts", [])}


def remote_job(name: str, output_claim: str, **spec) -> dict:
    doc = job_doc(name, model={"path": "hf://org/tiny@v1"}, output={"claimName": output_claim}, **spec)
    doc["spec"]["pod"]["volumeMounts"] = [m for m in doc["spec"]["pod"]["volumeMounts"] if m["mountPath"] != "/output"]
    return doc


def test_a_readwritemany_output_claim_is_shared_with_the_rollout_pods(cluster: Cluster, setup):
    ns = setup["ns"]
    claim(cluster, ns, "runs-rwx", "ReadWriteMany")
    claim(cluster, ns, "model-cache", "ReadWriteMany")
    create(cluster, ns, remote_job("shared", "runs-rwx", sourceCache={"claimName": "model-cache"}))
    pod = rollout_pod(cluster, ns, "shared")
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"output": "runs-rwx", "source-cache": "model-cache"}
    server, = pod["containers"]
    init, = pod["initContainers"]
    assert mounts(server)["output"] == ("/output", True) and mounts(init)["output"] == ("/output", False)
    assert mounts(server)["source-cache"] == (SOURCE_CACHE_DIR, True)
    assert mounts(init)["source-cache"] == (SOURCE_CACHE_DIR, False)
    assert "sources" not in mounts(server)


def test_a_readwriteonce_output_claim_leaves_the_rollout_pods_an_emptydir(cluster: Cluster, setup):
    ns = setup["ns"]
    claim(cluster, ns, "runs-rwo", "ReadWriteOnce")
    create(cluster, ns, remote_job("private", "runs-rwo"))
    pod = rollout_pod(cluster, ns, "private")
    assert {"name": "sources", "emptyDir": {}} in pod["volumes"]
    assert all(v["name"] != "output" for v in pod["volumes"])
    assert mounts(pod["containers"][0])["sources"] == ("/output/sources", False)
