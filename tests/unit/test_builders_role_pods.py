"""`trainer.pod` and `rollout.pod` over `spec.pod`: the rendered manifests of both backends put
the trainer and the rollout servers on different node pools, each with its own labels,
annotations, security context, scheduler, claims and ServiceAccount; every field is a real
Kubernetes field (the client's models read it back unchanged)."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client import ApiClient
from rlhf_contract.api import JobError, validate_job
from rlhf_operator.backends import build_children
from rlhf_operator.builders import PodSettingsError

UID = "0b7e6d2c-1111-4222-8333-944455556666"
POD = {  # every pod
    "labels": {"team": "math", "tier": "batch"},
    "annotations": {"example.com/owner": "lab"},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "research",
    "securityContext": {"runAsUser": 4242, "fsGroup": 5000},
    "serviceAccountAnnotations": {"iam.gke.io/gcp-service-account": "trainer@p.iam.gserviceaccount.com"},
    "volumes": [{"name": "work", "persistentVolumeClaim": {"claimName": "rlhf-work"}}],
    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
}
TRAINER_POD = {
    "labels": {"tier": "train"},
    "annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    "nodeSelector": {"pool": "h100"},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "DoNotSchedule",
                                   "labelSelector": {"matchLabels": {"rlhf.dev/job": "demo"}}}],
    "schedulerName": "volcano",
    "runtimeClassName": "nvidia",
    "resourceClaims": [{"name": "ib", "resourceClaimTemplateName": "rdma-nic"}],
}
ROLLOUT_POD = {
    "annotations": {"example.com/owner": "serving"},
    "nodeSelector": {"pool": "h20"},
    "tolerations": [{"key": "h20", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "spot",
    "securityContext": {"runAsUser": 3000, "runAsGroup": 3001, "fsGroupChangePolicy": "Always",
                        "supplementalGroups": [60]},
    "serviceAccountAnnotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/reader"},
    "acceleratorResource": "amd.com/gpu",
}


def job_data(backend="PyTorchJob", trainer_pod=TRAINER_POD, rollout_pod=ROLLOUT_POD, **trainer):
    return {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": UID},
        "spec": {"backend": backend, "model": {"path": "/work/models/qwen"}, "data": {"path": "/work/data.jsonl"},
                 "output": {"dir": "/work/runs/demo"}, "pod": copy.deepcopy(POD),
                 "runPolicy": {"terminationGracePeriodSeconds": 120},
                 "rollout": {"replicas": 2, "tensorParallelSize": 2, "pod": copy.deepcopy(rollout_pod)},
                 "trainer": {"numNodes": 2, "nprocPerNode": 4, "pod": copy.deepcopy(trainer_pod), **trainer}},
    }


def templates(children):
    """{role: [pod templates]} of either backend."""
    out = {"trainer": [], "rollout": []}
    for c in children:
        if c["kind"] == "StatefulSet":
            out["rollout"].append(c["spec"]["template"])
        elif c["kind"] == "PyTorchJob":
            out["trainer"] += [r["template"] for r in c["spec"]["pytorchReplicaSpecs"].values()]
        elif c["kind"] == "JobSet":
            for r in c["spec"]["replicatedJobs"]:
                out[r["name"]].append(r["template"]["spec"]["template"])
    return out


def roundtrip(obj, kind):
    api = ApiClient()
    return api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(obj), kind))


@pytest.mark.parametrize("backend", ["PyTorchJob", "JobSet"])
def test_trainer_and_rollout_pods_get_their_own_pool_annotations_and_security(backend):
    children = build_children(validate_job(job_data(backend)), 0)
    pods = templates(children)
    assert len(pods["trainer"]) >= 1 and len(pods["rollout"]) == 1
    for t in pods["trainer"]:
        assert roundtrip(t, "V1PodTemplateSpec") == t  # every key a real Kubernetes field
        meta, spec = t["metadata"], t["spec"]
        assert meta["labels"]["team"] == "math" and meta["labels"]["tier"] == "train"
        assert meta["labels"]["rlhf.dev/role"] == "trainer"
        assert meta["annotations"] == {"example.com/owner": "lab", "k8s.v1.cni.cncf.io/networks": "rdma-net"}
        assert spec["nodeSelector"] == {"pool": "h100"} and spec["tolerations"] == POD["tolerations"]
        assert spec["schedulerName"] == "volcano" and spec["runtimeClassName"] == "nvidia"
        assert spec["priorityClassName"] == "research"
        assert spec["topologySpreadConstraints"] == TRAINER_POD["topologySpreadConstraints"]
        assert spec["securityContext"] | {"seccompProfile": None} == {
            "runAsNonRoot": True, "runAsUser": 4242, "runAsGroup": 4242, "fsGroup": 5000,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": None}
        assert spec["resourceClaims"] == TRAINER_POD["resourceClaims"]
        res = spec["containers"][0]["resources"]
        assert res["claims"] == [{"name": "ib"}] and res["limits"]["nvidia.com/gpu"] == "4"
        assert spec["serviceAccountName"] == "demo-trainer" and spec["terminationGracePeriodSeconds"] == 120
    for r in pods["rollout"]:
        assert roundtrip(r, "V1PodTemplateSpec") == r
        meta, spec = r["metadata"], r["spec"]
        assert meta["labels"]["tier"] == "batch" and meta["labels"]["rlhf.dev/role"] == "rollout"
        assert meta["annotations"] == {"example.com/owner": "serving"}
        assert spec["nodeSelector"] == {"pool": "h20"} and spec["tolerations"] == ROLLOUT_POD["tolerations"]
        assert spec["priorityClassName"] == "spot"
        assert not {"schedulerName", "runtimeClassName", "resourceClaims", "topologySpreadConstraints"} & set(spec)
        assert spec["securityContext"]["runAsUser"] == 3000 and spec["securityContext"]["fsGroup"] == 3001
        assert spec["securityContext"]["fsGroupChangePolicy"] == "Always"
        assert spec["securityContext"]["supplementalGroups"] == [60]
        res = spec["containers"][0]["resources"]
        assert res["limits"] == {"amd.com/gpu": "2"} and "claims" not in res
        assert spec["serviceAccountName"] == "demo-rollout" and spec["automountServiceAccountToken"] is False
        assert spec["terminationGracePeriodSeconds"] == 120
    accounts = {c["metadata"]["name"]: c for c in children if c["kind"] == "ServiceAccount"}
    assert accounts["demo-trainer"]["metadata"]["annotations"] == POD["serviceAccountAnnotations"]
    assert accounts["demo-rollout"]["metadata"]["annotations"] == ROLLOUT_POD["serviceAccountAnnotations"]


def test_without_role_blocks_every_pod_gets_spec_pod_and_the_defaults():
    children = build_children(validate_job(job_data(trainer_pod={}, rollout_pod={})), 0)
    pods = templates(children)
    for t in pods["trainer"] + pods["rollout"]:
        assert t["spec"]["securityContext"]["runAsUser"] == 4242
        assert t["spec"]["priorityClassName"] == "research" and "nodeSelector" not in t["spec"]
        assert t["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    accounts = {c["metadata"]["name"]: c["metadata"]["annotations"] for c in children if c["kind"] == "ServiceAccount"}
    assert accounts == {"demo-trainer": POD["serviceAccountAnnotations"], "demo-rollout": POD["serviceAccountAnnotations"]}
    assert pods["rollout"][0]["spec"]["serviceAccountName"] == "demo-rollout"


def test_defaults_without_any_pod_settings():
    data = job_data(trainer_pod={}, rollout_pod={})
    data["spec"]["pod"] = {k: POD[k] for k in ("volumes", "volumeMounts")}
    del data["spec"]["runPolicy"]
    children = build_children(validate_job(data), 0)
    pod = templates(children)["trainer"][0]["spec"]
    assert "serviceAccountName" not in templates(children)["rollout"][0]["spec"]  # no IAM: no account of its own
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                                      "fsGroupChangePolicy": "OnRootMismatch",
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["terminationGracePeriodSeconds"] == 60


@pytest.mark.parametrize("change, message", [
    ({"trainer_pod": {"labels": {"rlhf.dev/role": "x"}}}, "spec.trainer.pod.labels: rlhf.dev/role: labels under rlhf.dev/"),
    ({"rollout_pod": {"securityContext": {"runAsUser": 0}}}, "spec.rollout.pod.securityContext.runAsUser"),
    ({"rollout_pod": {"acceleratorResource": "gpu"}}, "spec.rollout.pod.acceleratorResource"),
    ({"rollout_pod": {"securityContext": {"fsGroupChangePolicy": "Never"}}},
     "spec.rollout.pod.securityContext.fsGroupChangePolicy"),
])
def test_bad_role_settings_are_refused_with_the_field(change, message):
    with pytest.raises(JobError) as err:
        validate_job(job_data(**change))
    assert message in str(err.value)


def test_the_accelerator_resource_cannot_be_set_by_hand():
    data = job_data()
    data["spec"]["rollout"]["resources"] = {"limits": {"amd.com/gpu": "1"}}
    with pytest.raises(PodSettingsError, match=r"spec.rollout.resources: amd.com/gpu is set from rollout.tensorParallelSize"):
        build_children(validate_job(data), 0)


@pytest.mark.parametrize("labels, backend, expected", [
    ({}, None, "PyTorchJob"),
    ({"kueue.x-k8s.io/queue-name": "team"}, None, "JobSet"),  # Kueue admits a JobSet whole
    ({"kueue.x-k8s.io/queue-name": "team"}, "JobSet", "JobSet"),  # said explicitly: kept
])
def test_the_default_backend_follows_the_kueue_queue_label(labels, backend, expected):
    data = job_data(trainer_pod={}, rollout_pod={})
    del data["spec"]["backend"]
    if backend:
        data["spec"]["backend"] = backend
    data["metadata"]["labels"] = labels
    job = validate_job(data)
    assert job.spec.backend == expected
    kinds = {c["kind"] for c in build_children(job, 0)}
    assert ("JobSet" in kinds) == (expected == "JobSet") and ("PyTorchJob" in kinds) == (expected == "PyTorchJob")


@pytest.mark.parametrize("backend, method, placement, refused", [
    ("PyTorchJob", "rl", "separate", True),
    ("PyTorchJob", "sft", "separate", True),  # Kueue's PyTorchJob integration: off by default, deprecated
    ("TrainJob", "rl", "separate", True),  # the rollout StatefulSet beside the TrainJob: not admitted with it
    ("TrainJob", "sft", "separate", False),  # the TrainJob is the job's only workload
    ("TrainJob", "rl", "colocated", False),
    ("JobSet", "rl", "separate", False),
])
def test_a_queue_label_on_a_job_kueue_cannot_admit_whole_is_refused(backend, method, placement, refused):
    """Kueue admits one workload whole: a JobSet (trainer and servers), or a TrainJob when the
    trainer's pods are all the job has; anything else under a queue is refused naming the fix."""
    from rlhf_contract.api.rules import QUEUE_LABEL_BACKEND

    data = job_data(trainer_pod={}, rollout_pod={})
    data["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team"}
    data["spec"].update(backend=backend, method=method)
    data["spec"]["pod"]["volumeMounts"] = data["spec"]["pod"]["volumeMounts"][:1]  # a TrainJob: one mount per volume
    data["spec"]["pod"].pop("priorityClassName", None)  # no TrainJob field carries it
    if method == "sft":
        data["spec"].pop("rollout")
        data["spec"].pop("schedule", None)
    if placement == "colocated":
        data["spec"]["rollout"].update(placement="colocated", replicas=1, tensorParallelSize=1,
                                       vllm={"kvCacheMemoryBytes": 2 ** 30})
        data["spec"]["trainer"].update(numNodes=1, nprocPerNode=1)
    job = validate_job(data)
    assert QUEUE_LABEL_BACKEND.check(job) is not refused
    if not refused:
        assert build_children(job, 0)
        return
    with pytest.raises(PodSettingsError, match=r"spec\.backend: on a job with the label kueue\.x-k8s\.io/queue-name "
                       r"must be JobSet .*or drop the label \(got " + backend):
        build_children(job, 0)
    data["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": ""}  # an empty label is no queue (Kueue's reading too)
    assert QUEUE_LABEL_BACKEND.check(validate_job(data))
