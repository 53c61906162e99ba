"""`spec.backend: TrainJob`: the TrainJob manifest (Kubeflow Trainer v2.3, `runtimePatches`)
and the runtime it references. The pod Trainer v2 makes from runtime + TrainJob must be the
trainer pod the other backends build (same contract, labels included), and what v2.3 cannot
carry is refused by field."""

from __future__ import annotations

import copy
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from helpers import fake_pod, job_of
from rlhf_contract.api import validate_job
from rlhf_contract.exit_codes import ExitCode
from rlhf_operator.backends import build_children, build_workloads, job_settings
from rlhf_operator.backends.trainjob import TrainJobError
from rlhf_operator.builders import PodSettings, PodSettingsError
from rlhf_operator.backends.trainjob import NODE, RUNTIME_NAME, TORCH_ENV, adoption_labels, build_runtime
from rlhf_operator.status import Observed, plan
from test_builders import check_schema, children_of, make_job

REPO = Path(__file__).resolve().parents[2]


def job_data(**spec) -> dict:
    """test_builders' job, its volume mounted once (a TrainJob keys mounts by volume name)."""
    data = make_job(backend="TrainJob", **spec)
    data["spec"]["pod"]["volumeMounts"] = [{"name": "models", "mountPath": "/models", "readOnly": True}]
    data["spec"]["data"]["path"] = "/models/data/train.jsonl"
    return data


def trainjob_of(data) -> dict:
    return children_of(data)[("TrainJob", "demo-trainer")]


def _by_name(items: list[dict]) -> dict[str, dict]:
    return {i["name"]: i for i in items}


def effective_pod(runtime: dict, tj: dict) -> dict:
    """The trainer pod Trainer v2.3 builds: the runtime's `node` pod with each runtime patch's
    `node` pod template merged in (a strategic merge patch over JobSetSpec, as
    TrainingRuntime.mergeRuntimePatches: maps merged, volumes and containers by name, mounts
    by mountPath, tolerations replaced), then the torch plugin's and the JobSet builder's
    `trainer` fields on container `node`."""
    pod = copy.deepcopy(runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    spec = pod["spec"]
    for patch in tj["spec"]["runtimePatches"]:
        assert patch["manager"] == "rlhf.dev/operator"
        (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert rjob["name"] == NODE
        template = rjob["template"]["spec"]["template"]
        for key, value in template["metadata"].items():
            pod["metadata"][key] = {**pod["metadata"].get(key, {}), **value}
        over = template["spec"]
        for key in ("serviceAccountName", "nodeSelector", "tolerations", "affinity", "securityContext",
                    "terminationGracePeriodSeconds"):
            if key in over:
                spec[key] = over[key]
        spec["volumes"] = list({**_by_name(spec["volumes"]), **_by_name(over.get("volumes", []))}.values())
        containers = _by_name(spec["containers"])
        for c in over.get("containers", []):
            mounts = {m["mountPath"]: m for m in [*containers[c["name"]]["volumeMounts"], *c.get("volumeMounts", [])]}
            containers[c["name"]]["volumeMounts"] = list(mounts.values())  # corev1's merge key: mountPath
    node = _by_name(spec["containers"])[NODE]
    t = tj["spec"]["trainer"]
    node.update(image=t["image"], command=t["command"], resources=t["resourcesPerNode"])
    node["env"] = list({**_by_name(node["env"]), **_by_name(t["env"])}.values())
    return pod


def _sorted(spec: dict) -> dict:
    """`spec` in one order, env entries with an empty value as Go writes them (the same variable)."""
    spec = copy.deepcopy(spec)
    for c in spec["containers"]:
        c["env"] = [{"name": e["name"]} if e.get("value") == "" else e for e in c["env"]]
    spec["volumes"] = sorted(spec["volumes"], key=lambda v: v["name"])
    for c in spec["containers"]:
        c["name"] = NODE
        for key in ("env", "volumeMounts"):
            c[key] = sorted(c[key], key=lambda v: (v["name"], v.get("mountPath", "")))
    spec.pop("imagePullSecrets", None)
    return spec


def test_the_pod_trainer_v2_makes_is_the_pytorchjob_backends_trainer_pod():
    data = job_data()
    tj = trainjob_of(data)
    assert tj["spec"]["runtimeRef"] == {"name": RUNTIME_NAME, "apiGroup": "trainer.kubeflow.org",
                                        "kind": "ClusterTrainingRuntime"}
    assert tj["spec"]["trainer"]["numNodes"] == 2 and tj["spec"]["trainer"]["numProcPerNode"] == 8
    assert not {e["name"] for e in tj["spec"]["trainer"]["env"]} & set(TORCH_ENV)  # Trainer's webhook refuses them
    # as Go's EnvVar writes it: Kueue's whole-object update must not change the immutable spec.trainer
    assert not [e for e in tj["spec"]["trainer"]["env"] if e.get("value") == ""]
    made = effective_pod(build_runtime("any:1"), tj)
    ptj = children_of({**data, "spec": {**data["spec"], "backend": "PyTorchJob"}})[("PyTorchJob", "demo-trainer")]
    want = copy.deepcopy(ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"])
    # the attempt a trainer keeps its log under is the pod's label, as under PyTorchJob: v2.3's
    # runtime patch labels the pods from birth
    assert made["metadata"]["labels"]["rlhf.dev/attempt"] == "0"
    assert {"name": "RLHF_ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['rlhf.dev/attempt']"}}} \
        in tj["spec"]["trainer"]["env"]
    assert _sorted(made["spec"]) == _sorted(want["spec"])
    # v2.3's runtime patch labels the pods as the job's from birth (no adoption), as PyTorchJob's
    assert made["metadata"] == {**want["metadata"], "labels": {**want["metadata"]["labels"],
                                                               "app.kubernetes.io/managed-by": "rlhf-operator"}}
    assert made["metadata"]["labels"]["rlhf.dev/job-uid"] == data["metadata"]["uid"]
    js_labels = tj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["metadata"]["labels"]
    assert js_labels["rlhf.dev/job"] == "demo" and js_labels["rlhf.dev/attempt"] == "0"
    queued = job_data(method="sft")  # the TrainJob alone: Kueue admits it whole
    for key in ("rollout", "schedule"):
        queued["spec"].pop(key)
    queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "gpu-queue"
    tj = trainjob_of(queued)
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"  # what Kueue reads


def test_rollout_servers_stay_a_statefulset_and_rank_0_is_found_by_jobset_labels():
    children = children_of(job_data(), attempt=3)
    assert children[("StatefulSet", "demo-rollout")]["metadata"]["labels"]["rlhf.dev/attempt"] == "3"
    assert children[("TrainJob", "demo-trainer")]["metadata"]["labels"]["rlhf.dev/attempt"] == "3"
    assert ("Service", "demo-rollout") in children and ("PyTorchJob", "demo-trainer") not in children
    selector = children[("Service", "demo-weight-sync")]["spec"]["selector"]
    # Trainer v2 names the JobSet as the TrainJob and its trainer job `node`
    assert selector == {"jobset.sigs.k8s.io/jobset-name": "demo-trainer",
                        "jobset.sigs.k8s.io/replicatedjob-name": NODE,
                        "batch.kubernetes.io/job-completion-index": "0"}


def test_pull_secrets_move_to_the_trainers_service_account_and_suspend_is_the_trainjobs():
    data = job_data(suspend=True)
    data["spec"]["pod"]["imagePullSecrets"] = ["regcred"]
    children = children_of(data)
    assert children[("ServiceAccount", "demo-trainer")]["imagePullSecrets"] == [{"name": "regcred"}]
    assert children[("TrainJob", "demo-trainer")]["spec"]["suspend"] is True
    assert "imagePullSecrets" not in children_of(make_job())[("ServiceAccount", "demo-trainer")]


@pytest.mark.parametrize("where, value", [
    ("pod", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}}),
    ("trainer.pod", {"labels": {"team": "a"}}),
    ("pod", {"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma"}}),
    ("runPolicy", {"terminationGracePeriodSeconds": 300}),
])
def test_what_v2_0_could_not_carry_a_v2_3_runtime_patch_does(where, value):
    """Affinity, the user's pod labels and annotations, another grace period: Trainer v2.0
    refused them, v2.3's runtime patch carries them, and the pod is still PyTorchJob's."""
    data = job_data()
    if where == "pod":
        data["spec"]["pod"].update(value)
    elif where == "trainer.pod":
        data["spec"]["trainer"]["pod"] = value
    else:
        data["spec"][where] = value
    tj = trainjob_of(data)
    made = effective_pod(build_runtime("any:1"), tj)
    ptj = children_of({**data, "spec": {**data["spec"], "backend": "PyTorchJob"}})[("PyTorchJob", "demo-trainer")]
    want = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert _sorted(made["spec"]) == _sorted(want["spec"])
    assert {**want["metadata"]["labels"], **made["metadata"]["labels"]} == made["metadata"]["labels"]
    assert made["metadata"].get("annotations") == want["metadata"].get("annotations")


@pytest.mark.parametrize("where, value, blamed", [
    ("pod", {"priorityClassName": "high"}, "spec.pod.priorityClassName"),
    ("pod", {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]},
     "spec.pod.topologySpreadConstraints"),
    ("storageSecret", "creds", "spec.storageSecret"),
    ("model", {"path": "hf://Qwen/Qwen2.5-0.5B"}, "spec.model.path"),
    ("twice", None, "spec.pod.volumeMounts"),
])
def test_what_a_v2_3_trainjob_cannot_carry_is_refused_naming_the_field(where, value, blamed):
    data = job_data()
    if where == "pod":
        data["spec"]["pod"].update(value)
    elif where == "twice":
        data["spec"]["pod"]["volumeMounts"].append({"name": "models", "mountPath": "/data", "subPath": "data"})
    elif where == "trainer.pod":
        data["spec"]["trainer"]["pod"] = value
    else:
        data["spec"][where] = value
    with pytest.raises(TrainJobError, match="spec.backend JobSet") as err:
        children_of(data)
    assert blamed in str(err.value)
    # what the operator calls first: a PodSettingsError, so the job is Failed (InvalidSpec) at once
    with pytest.raises(PodSettingsError, match=blamed.replace(".", r"\.")):
        job_settings(validate_job(copy.deepcopy(data)))


def _trainer_crd(name: str) -> dict:
    out = subprocess.run(["bash", str(REPO / "tests/cluster/trainer/build.sh"), "--print"], capture_output=True,
                         text=True)
    path = Path(out.stdout.strip()) / "crds" / f"trainer.kubeflow.org_{name}.yaml"
    if not path.exists():
        pytest.skip(f"Trainer v2 CRDs not built yet ({path}); `make trainer-bin` builds them")
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)  # 0.9 MB: the C parser
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")["schema"]["openAPIV3Schema"]


def test_trainjob_and_runtime_match_trainer_v2_crd_schemas():
    tj = trainjob_of(job_data())
    schema = _trainer_crd("trainjobs")
    assert check_schema({k: v for k, v in tj.items() if k != "metadata"}, schema) == []
    bad = copy.deepcopy(tj)
    bad["spec"]["trainer"]["numProcsPerNode"] = 8
    assert len(check_schema({k: v for k, v in bad.items() if k != "metadata"}, schema)) == 1
    old = copy.deepcopy(tj)  # Trainer v2.0's field: gone from v2.3's schema
    old["spec"]["podSpecOverrides"] = [{"targetJobs": [{"name": NODE}]}]
    assert len(check_schema({k: v for k, v in old.items() if k != "metadata"}, schema)) == 1
    full = trainjob_of(job_data(pod={"affinity": {"nodeAffinity": {}}, "annotations": {"a.io/b": "c"},
                                     "volumes": [{"name": "models", "emptyDir": {}}],
                                     "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}))
    assert check_schema({k: v for k, v in full.items() if k != "metadata"}, schema) == []
    runtime = build_runtime("ghcr.io/rlhf-operator/trainer:0.1.0")
    assert check_schema({k: v for k, v in runtime.items() if k != "metadata"},
                        _trainer_crd("clustertrainingruntimes")) == []


def test_offline_methods_get_the_trainjob_alone():
    data = job_data(method="sft")
    for key in ("rollout", "schedule"):
        data["spec"].pop(key)
    job = validate_job(copy.deepcopy(data))
    kinds = [w["kind"] for w in build_workloads(job, 0, PodSettings.from_job(job))]
    assert kinds == ["TrainJob"]
    assert "StatefulSet" not in [c["kind"] for c in build_children(job, 0)]


# ---- the status read from a TrainJob and its pods, and the pods' adoption ----------------

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
JOB_UID, TJ_UID, JS_UID = "uid-job", "uid-tj", "uid-js"


def status_body(restarts=0, max_restarts=2):
    data = job_data(runPolicy={"maxRestarts": max_restarts})
    data["metadata"].update(uid=JOB_UID, generation=1,
                            creationTimestamp=(NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ"))
    return {**data, "status": {"phase": "Running", "restarts": restarts}}


def workload(kind, attempt=0, conditions=()):
    return {"kind": kind, "metadata": {"name": "demo-x", "uid": TJ_UID, "labels": {"rlhf.dev/job": "demo",
                                                                                  "rlhf.dev/attempt": str(attempt)},
                                       "ownerReferences": [{"uid": JOB_UID, "controller": True}]},
            "status": {"conditions": [{"type": t, "status": "True", "reason": t, "message": m,
                                       "lastTransitionTime": "2026-01-01T11:00:00Z"} for t, m in conditions]}}


def observed(attempt=0, conditions=(), **trainer_pod):
    pods = [fake_pod(f"demo-rollout-{i}", {"rlhf.dev/role": "rollout", "rlhf.dev/job-uid": JOB_UID,
                                           "rlhf.dev/attempt": str(attempt)}) for i in range(3)]
    pods += [fake_pod(f"demo-trainer-node-0-{i}", {"rlhf.dev/role": "trainer", "rlhf.dev/job-uid": JOB_UID,
                                                   "rlhf.dev/attempt": str(attempt)}, **(trainer_pod if i else {}))
             for i in range(2)]
    return Observed(statefulset=workload("StatefulSet", attempt), trainjob=workload("TrainJob", attempt, conditions),
                    pods=pods)


def test_trainjob_complete_is_succeeded_and_the_servers_go():
    p = plan(status_body(), job_of(status_body()), observed(conditions=[("Complete", "jobset completed")]), NOW)
    assert p.status["phase"] == "Succeeded" and p.delete == ["StatefulSet"]
    running = plan(status_body(), job_of(status_body()), observed(), NOW)
    assert running.status["phase"] == "Running" and not running.delete


def test_a_failed_trainer_pod_restarts_the_whole_job_deleting_the_trainjob():
    p = plan(status_body(), job_of(status_body()), observed(phase="Failed", exit_code=1), NOW)
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    assert sorted(p.delete) == ["StatefulSet", "TrainJob"]


def test_a_permanent_exit_code_fails_at_once_keeping_the_trainjob_for_its_logs():
    p = plan(status_body(), job_of(status_body()),
             observed(phase="Failed", exit_code=int(ExitCode.CONFIG_ERROR)), NOW)
    assert p.status["phase"] == "Failed" and p.status["conditions"][-1]["reason"] == "PermanentError"
    assert p.delete == ["StatefulSet"]


def test_a_failed_trainjob_without_its_pod_in_sight_restarts_after_the_evidence_grace():
    obs = observed(conditions=[("Failed", "jobset failed")])
    p = plan(status_body(), job_of(status_body()), obs, NOW)
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    assert "jobset failed" in p.status["message"]


def _adoption_objects():
    tj = {"metadata": {"uid": TJ_UID, "labels": {"rlhf.dev/job": "demo", "rlhf.dev/attempt": "2"},
                       "ownerReferences": [{"uid": JOB_UID, "controller": True}]}}
    js = {"metadata": {"uid": JS_UID, "ownerReferences": [{"uid": TJ_UID, "controller": True}]}}
    pod = {"metadata": {"labels": {"jobset.sigs.k8s.io/jobset-uid": JS_UID}}}
    return tj, js, pod


def test_a_pod_of_our_trainjobs_jobset_is_adopted_with_the_jobs_labels():
    tj, js, pod = _adoption_objects()
    assert adoption_labels(tj, js, pod) == {"rlhf.dev/job": "demo", "rlhf.dev/job-uid": JOB_UID,
                                            "rlhf.dev/attempt": "2"}


def test_pods_of_another_jobset_or_trainjob_are_not_adopted():
    tj, js, pod = _adoption_objects()
    pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-uid"] = "uid-an-older-jobset"
    assert adoption_labels(tj, js, pod) is None
    tj, js, pod = _adoption_objects()
    js["metadata"]["ownerReferences"][0]["uid"] = "uid-another-trainjob"
    assert adoption_labels(tj, js, pod) is None
    assert adoption_labels(tj, None, pod) is None
