"""The pure builders: every child checked against the Kubernetes OpenAPI models (a round
trip through the `kubernetes` client's models loses no field) and the PyTorchJob against
the training-operator's CRD schema; then the specific structure each child must have."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes.client import ApiClient

from rlhf_contract import pod as contract
from rlhf_contract.api import validate_job
from rlhf_operator.backends import build_children, rollout_endpoints
from rlhf_operator.builders import weight_sync_addr
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_operator.builders.pods import CONFIG_PATH

REPO = Path(__file__).resolve().parents[2]
UID = "0b7e6d2c-1111-4222-8333-944455556666"

MODEL_CLASS = {
    "ConfigMap": "V1ConfigMap", "ServiceAccount": "V1ServiceAccount", "Role": "V1Role",
    "RoleBinding": "V1RoleBinding", "Service": "V1Service", "NetworkPolicy": "V1NetworkPolicy",
    "StatefulSet": "V1StatefulSet",
}


def make_job(**spec_overrides):
    data = {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": UID,
                     "labels": {"kueue.x-k8s.io/priority-class": "gpu-high"}},
        "spec": {"backend": "PyTorchJob",
                 "model": {"path": "/models/qwen"}, "data": {"path": "/data/train.jsonl"},
                 "rollout": {"replicas": 3, "tensorParallelSize": 2},
                 "trainer": {"numNodes": 2, "nprocPerNode": 8}, "schedule": {"promptsPerStep": 32},
                 "output": {"claimName": "runs"},
                 "pod": {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
                         "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                                          {"name": "models", "mountPath": "/data", "subPath": "data"}]}},
    }
    for key, value in spec_overrides.items():
        data["spec"][key] = value
    return data


def children_of(data, attempt=0):
    job = validate_job(copy.deepcopy(data))
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(job, attempt)}


def roundtrip(obj: dict, klass: str) -> None:
    api = ApiClient()
    model = api._ApiClient__deserialize(copy.deepcopy(obj), klass)
    assert api.sanitize_for_serialization(model) == obj, f"{klass}: a field is unknown to the Kubernetes model"


def test_every_child_round_trips_through_the_kubernetes_models():
    children = children_of(make_job())
    kinds = sorted(k for k, _ in children)
    assert kinds == ["ConfigMap", "NetworkPolicy", "PyTorchJob", "Role", "RoleBinding", "Service", "Service",
                     "ServiceAccount", "StatefulSet"]
    for (kind, _), obj in children.items():
        if kind == "PyTorchJob":
            for spec in obj["spec"]["pytorchReplicaSpecs"].values():
                roundtrip(spec["template"], "V1PodTemplateSpec")
        else:
            roundtrip(obj, MODEL_CLASS[kind])


def test_roundtrip_check_catches_a_misspelt_field():
    sts = children_of(make_job())[("StatefulSet", "demo-rollout")]
    sts["spec"]["template"]["spec"]["nodeSelecter"] = {"a": "b"}
    with pytest.raises(AssertionError):
        roundtrip(sts, "V1StatefulSet")


# -------- a small structural-schema check (types, unknown fields, required, enums)

def check_schema(value, schema, path="") -> list[str]:
    errors = []
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) else [f"{path}: not int-or-string"]
    typ = schema.get("type")
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "boolean": bool, "number": (int, float)}
    if typ and not isinstance(value, kinds[typ]):
        return [f"{path}: expected {typ}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if typ == "object":
        props = schema.get("properties")
        for req in schema.get("required", []):
            if req not in value:
                errors.append(f"{path}.{req}: required")
        for key, sub in value.items():
            if props is not None and key in props:
                errors += check_schema(sub, props[key], f"{path}.{key}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += check_schema(sub, schema["additionalProperties"], f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{key}: unknown field")
    if typ == "array":
        for i, item in enumerate(value):
            errors += check_schema(item, schema.get("items", {}), f"{path}[{i}]")
    return errors


def pytorchjob_schema() -> dict:
    out = subprocess.run(["bash", str(REPO / "tests/cluster/build.sh"), "--print"], capture_output=True, text=True)
    path = Path(out.stdout.strip()) / "manifests" / "kubeflow.org_pytorchjobs.yaml"
    if not path.exists():
        pytest.skip(f"PyTorchJob CRD not built yet ({path}); `make cluster-bin` builds it")
    crd = yaml.safe_load(path.read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def test_pytorchjob_matches_the_training_operator_crd_schema():
    schema = pytorchjob_schema()
    ptj = children_of(make_job())[("PyTorchJob", "demo-trainer")]
    body = {k: v for k, v in ptj.items() if k != "metadata"}
    assert check_schema(body, schema) == []
    bad = copy.deepcopy(body)
    bad["spec"]["runPolicy"]["backoffLimit"] = "none"
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicaz"] = 1
    assert len(check_schema(bad, schema)) == 2


# -------- structure

def test_names_labels_and_owner_references():
    children = children_of(make_job(), attempt=4)
    assert set(children) == {
        ("ConfigMap", "demo-config"), ("ServiceAccount", "demo-trainer"), ("Role", "demo-trainer"),
        ("RoleBinding", "demo-trainer"), ("Service", "demo-rollout"), ("Service", "demo-weight-sync"),
        ("NetworkPolicy", "demo"), ("StatefulSet", "demo-rollout"), ("PyTorchJob", "demo-trainer"),
    }
    for obj in children.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"]["rlhf.dev/job"] == "demo"
        assert meta["ownerReferences"] == [{"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "name": "demo",
                                            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
    sts = children[("StatefulSet", "demo-rollout")]
    ptj = children[("PyTorchJob", "demo-trainer")]
    templates = [sts["spec"]["template"]] + [s["template"] for s in ptj["spec"]["pytorchReplicaSpecs"].values()]
    for t in templates:
        assert t["metadata"]["labels"]["rlhf.dev/attempt"] == "4"
        assert t["metadata"]["labels"]["rlhf.dev/job-uid"] == UID
        assert t["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "gpu-high"
    # The selector must not contain the attempt (immutable; the StatefulSet is replaced on restart).
    assert sts["spec"]["selector"]["matchLabels"] == {"rlhf.dev/job": "demo", "rlhf.dev/role": "rollout"}


def test_config_map_holds_the_trainer_config_with_the_preset_resolved():
    cm = children_of(make_job(algorithm={"preset": "dapo"}))[("ConfigMap", "demo-config")]
    config = TrainerConfig.from_json(cm["data"]["trainer.json"])  # the trainer pods can read it back
    assert (config.job_name, config.namespace) == ("demo", "team-a")
    assert config.algorithm.clip_high == 0.28  # preset resolved
    assert config.algorithm.overlong_buffer == 1024 // 5
    raw = json.loads(cm["data"]["trainer.json"])
    assert not {"image", "replicas", "runPolicy", "numNodes"} & set(_all_keys(raw))  # nothing the trainer does not read


def _all_keys(data) -> list[str]:
    if isinstance(data, dict):
        return [k for k, v in data.items() for k in (k, *_all_keys(v))]
    return []


def test_rollout_statefulset_uses_the_contract_gpus_probes_and_restricted_security():
    data = make_job()
    job = validate_job(copy.deepcopy(data))
    sts = children_of(data)[("StatefulSet", "demo-rollout")]
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec["serviceName"] == "demo-rollout"
    assert spec["podManagementPolicy"] == "Parallel" and spec["updateStrategy"] == {"type": "OnDelete"}
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    proc = contract.rollout_process(job, model_path="/models/qwen", host="0.0.0.0", port=contract.ROLLOUT_PORT)
    assert c["command"] == proc.command
    assert c["command"][:3] == ["vllm", "serve", "/models/qwen"] and "--tensor-parallel-size" in c["command"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and "RLHF_TRAINER_CONFIG" not in env  # all on the command line
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"} == c["resources"]["requests"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
    longer = children_of(make_job(rollout={"replicas": 3, "tensorParallelSize": 2, "startupTimeoutSeconds": 3600}))
    probe = longer[("StatefulSet", "demo-rollout")]["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == 3600  # the trainer's wait, one setting
    assert_restricted(pod)
    assert pod["restartPolicy"] == "Always" and pod["automountServiceAccountToken"] is False


def test_trainer_pytorchjob_uses_the_contract_and_the_training_operator_conventions():
    data = make_job()
    job = validate_job(copy.deepcopy(data))
    ptj = children_of(data)[("PyTorchJob", "demo-trainer")]
    spec = ptj["spec"]
    assert spec["nprocPerNode"] == "8"
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 0}
    replicas = spec["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 1}
    endpoints = ["http://demo-rollout-0.demo-rollout.team-a.svc:8000",
                 "http://demo-rollout-1.demo-rollout.team-a.svc:8000",
                 "http://demo-rollout-2.demo-rollout.team-a.svc:8000"]
    assert rollout_endpoints(job) == endpoints
    assert weight_sync_addr(job) == "demo-weight-sync.team-a.svc:29600"
    proc = contract.trainer_process(job, config_path=CONFIG_PATH, rollout_endpoints=endpoints,
                                    weight_sync_addr="demo-weight-sync.team-a.svc:29600", output_dir="/output")
    for role in replicas.values():
        assert role["restartPolicy"] == "Never"
        pod = role["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch"
        assert c["command"] == proc.command
        assert "--nnodes=2" in c["command"] and "--nproc-per-node=8" in c["command"]
        assert not any(a.startswith("--master-addr") for a in c["command"])  # PET_* from the training-operator
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env[k] for k in proc.env} == proc.env
        assert env["RLHF_ROLLOUT_ENDPOINTS"] == ",".join(endpoints) and env["RLHF_RESUME"] == "1"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"pytorchjob-port": 29500, "weight-sync": 29600,
                                                                      "metrics": 9400}
        assert env["RLHF_METRICS_PORT"] == "9400"  # rank 0 serves Prometheus there
        # where the pod keeps its log on the volume (rlhf_trainer.podlog): its name and attempt
        assert {e["name"]: e.get("valueFrom") for e in c["env"] if e["name"] in ("RLHF_POD_NAME", "RLHF_ATTEMPT")} == {
            "RLHF_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
            "RLHF_ATTEMPT": {"fieldRef": {"fieldPath": "metadata.labels['rlhf.dev/attempt']"}}}
        assert role["template"]["metadata"]["labels"]["rlhf.dev/attempt"] == "0"
        assert pod["serviceAccountName"] == "demo-trainer"
        assert_restricted(pod)


def test_single_node_trainer_has_no_workers():
    ptj = children_of(make_job(trainer={"numNodes": 1, "nprocPerNode": 4}))[("PyTorchJob", "demo-trainer")]
    assert list(ptj["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def assert_restricted(pod: dict) -> None:
    """The checks of the `restricted` Pod Security Standard (v1.34) that apply here."""
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in pod["containers"]:
        csc = c["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"] == {"drop": ["ALL"]}
        assert "add" not in csc["capabilities"] and not csc.get("privileged")
    allowed = {"configMap", "emptyDir", "projected", "secret", "downwardAPI", "persistentVolumeClaim", "ephemeral",
               "csi", "name"}
    for v in pod["volumes"]:
        assert set(v) <= allowed, v
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory"}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["config"] == "/etc/rlhf"


def test_rbac_lets_the_trainer_patch_only_its_own_status():
    children = children_of(make_job())
    role = children[("Role", "demo-trainer")]
    assert role["rules"] == [
        {"apiGroups": ["rlhf.dev"], "resources": ["rlhfjobs"], "resourceNames": ["demo"], "verbs": ["get"]},
        {"apiGroups": ["rlhf.dev"], "resources": ["rlhfjobs/status"], "resourceNames": ["demo"],
         "verbs": ["get", "patch"]},
    ]
    rb = children[("RoleBinding", "demo-trainer")]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "demo-trainer", "namespace": "team-a"}]
    assert rb["roleRef"]["name"] == "demo-trainer"


def test_services_and_network_policy():
    children = children_of(make_job())
    rollout = children[("Service", "demo-rollout")]["spec"]
    assert rollout["clusterIP"] == "None"
    assert rollout["selector"] == {"rlhf.dev/job": "demo", "rlhf.dev/role": "rollout"}
    sync = children[("Service", "demo-weight-sync")]["spec"]
    assert sync["selector"] == {"training.kubeflow.org/job-name": "demo-trainer",
                                "training.kubeflow.org/replica-type": "master",
                                "training.kubeflow.org/replica-index": "0"}
    assert sync["ports"][0]["port"] == 29600
    np = children[("NetworkPolicy", "demo")]["spec"]
    assert np["podSelector"] == {"matchLabels": {"rlhf.dev/job": "demo"}}
    assert np["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"rlhf.dev/job": "demo"}}}]}]


def test_builders_are_pure_and_deterministic():
    data = make_job()
    assert children_of(data) == children_of(data)
    assert children_of(data, 1)[("ConfigMap", "demo-config")] == children_of(data, 2)[("ConfigMap", "demo-config")]


def test_the_cluster_example_builds_with_its_pod_block():
    data = yaml.safe_load((REPO / "examples" / "rlhfjob.yaml").read_text())
    data["metadata"].update(namespace="ml", uid=UID)
    children = children_of(data)
    sts = children[("StatefulSet", "qwen-math-grpo-rollout")]
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"name": "work", "mountPath": "/work"} in pod["containers"][0]["volumeMounts"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                                                 "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"}}
    ptj = children[("PyTorchJob", "qwen-math-grpo-trainer")]
    env = {e["name"]: e.get("value") for e in ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["RLHF_OUTPUT_DIR"] == "/work/runs/qwen-math-grpo"
    roundtrip(sts, "V1StatefulSet")


@pytest.mark.parametrize("method", ["sft", "rm", "dpo"])
def test_offline_methods_get_the_trainer_alone(method):
    data = make_job(method=method)
    data["spec"].pop("rollout")
    children = children_of(data)
    kinds = sorted({kind for kind, _ in children})
    assert "StatefulSet" not in kinds and "Service" not in kinds, kinds  # no rollout servers, no services
    ptj = next(c for (kind, _), c in children.items() if kind == "PyTorchJob")
    env = {e["name"]: e.get("value") for spec in ptj["spec"]["pytorchReplicaSpecs"].values()
           for c in spec["template"]["spec"]["containers"] for e in c.get("env", [])}
    assert env[contract.ENV_ROLLOUT_ENDPOINTS] == ""
    config = json.loads(children[("ConfigMap", "demo-config")]["data"]["trainer.json"])
    assert config["method"] == method


def test_a_cpu_job_requests_no_accelerator_on_any_pod():
    """`rollout.engine: cpu` and `trainer.device: cpu`: the pods fit a node without GPUs (the
    real test node runs such a job), the trainer hides any GPU, and CPU and memory stay as asked."""
    cpu = {"requests": {"cpu": "500m", "memory": "2Gi"}}
    children = children_of(make_job(rollout={"engine": "cpu", "replicas": 2, "resources": cpu},
                                    trainer={"nprocPerNode": 2, "device": "cpu", "resources": cpu}))
    sts = children[("StatefulSet", "demo-rollout")]["spec"]["template"]["spec"]["containers"][0]
    ptj = children[("PyTorchJob", "demo-trainer")]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    trainer = ptj["containers"][0]
    for c in (sts, trainer):
        assert c["resources"] == {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    # the same job on GPUs asks for them (nprocPerNode per trainer pod; none for the CPU engine still)
    gpu = children_of(make_job(rollout={"engine": "cpu", "replicas": 2}, trainer={"nprocPerNode": 2}))
    gpu_trainer = gpu[("PyTorchJob", "demo-trainer")]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert gpu_trainer["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert "CUDA_VISIBLE_DEVICES" not in {e["name"] for e in gpu_trainer["containers"][0]["env"]}


def test_a_cpu_trainer_with_vllm_servers_is_refused_naming_the_field():
    """A trainer on CPU cannot send weights to vLLM over NCCL: refused on a cluster before
    anything starts (the CRD's CEL says the same; local mode always runs the CPU engine)."""
    from rlhf_contract.api.rules import CLUSTER_RULES

    job = validate_job(copy.deepcopy(make_job(trainer={"device": "cpu"})))
    broken = [r for r in CLUSTER_RULES if not r.check(job.spec)]
    assert [r.field_path for r in broken] == ["trainer.device"] and "rollout.engine: cpu" in broken[0].message
    sft_data = make_job(trainer={"device": "cpu"}, method="sft")
    del sft_data["spec"]["rollout"]
    sft = validate_job(sft_data)
    cpu = validate_job(copy.deepcopy(make_job(trainer={"device": "cpu"}, rollout={"engine": "cpu"})))
    assert all(r.check(sft.spec) and r.check(cpu.spec) for r in CLUSTER_RULES if r.field_path == "trainer.device")
