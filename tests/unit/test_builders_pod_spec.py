"""`spec.pod`, `spec.output.claimName` and `resources`: what every pod gets on a real
cluster (scheduling, volumes, CPU / memory), and jobs refused because a path they need is
on no mounted volume (the message names the field)."""

from __future__ import annotations

import copy

import pytest
from kubernetes.client import ApiClient
from rlhf_contract.api import JobError, validate_job
from rlhf_operator.backends import build_children
from rlhf_operator.builders import PodSettings, PodSettingsError

UID = "0b7e6d2c-1111-4222-8333-944455556666"
POD = {
    "nodeSelector": {"nvidia.com/gpu.product": "H100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
    "priorityClassName": "training",
    "imagePullSecrets": ["regcred"],
    "volumes": [{"name": "work", "persistentVolumeClaim": {"claimName": "rlhf-work"}}],
    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
}


def job_data(pod=POD, output=None, model="/work/models/qwen", data="/work/data/train.jsonl", **spec):
    return {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "demo", "namespace": "team-a", "uid": UID},
        "spec": {"model": {"path": model}, "data": {"path": data}, "pod": copy.deepcopy(pod),
                 "output": {"dir": "/work/runs/demo"} if output is None else output,
                 "rollout": {"replicas": 2}, "trainer": {"numNodes": 2, "nprocPerNode": 4}, **spec},
    }


def pods_of(data):
    children = {c["kind"]: c for c in build_children(validate_job(data), 0) if c["kind"] in ("StatefulSet", "PyTorchJob")}
    sts, ptj = children["StatefulSet"], children["PyTorchJob"]
    trainers = [r["template"]["spec"] for r in ptj["spec"]["pytorchReplicaSpecs"].values()]
    return sts["spec"]["template"]["spec"], trainers, sts


class TestScheduling:
    def test_every_pod_gets_the_pod_block(self):
        rollout, trainers, sts = pods_of(job_data())
        assert len(trainers) == 2  # Master and Worker
        for pod in [rollout, *trainers]:
            assert pod["nodeSelector"] == POD["nodeSelector"]
            assert pod["tolerations"] == POD["tolerations"]
            assert pod["affinity"] == POD["affinity"]
            assert pod["priorityClassName"] == "training"
            assert pod["imagePullSecrets"] == [{"name": "regcred"}]
            assert POD["volumes"][0] in pod["volumes"]
            assert {"name": "work", "mountPath": "/work"} in pod["containers"][0]["volumeMounts"]
        api = ApiClient()  # the affinity and tolerations are real Kubernetes objects
        assert api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(sts), "V1StatefulSet")) == sts

    def test_an_empty_pod_block_adds_no_scheduling_keys(self):
        rollout, trainers, _ = pods_of(job_data(pod={}, model="builtin://tiny-qwen2", data="builtin://last-digit",
                                                output={"claimName": "runs"}))
        for pod in [rollout, *trainers]:
            assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"} & set(pod)


class TestResources:
    def test_cpu_and_memory_join_the_gpus_and_memory_gets_a_limit(self):
        rollout, trainers, _ = pods_of(job_data(
            trainer={"numNodes": 2, "nprocPerNode": 4, "resources": {"requests": {"cpu": 16, "memory": "200Gi"}}},
            rollout={"replicas": 2, "tensorParallelSize": 2, "resources": {"requests": {"cpu": "4"},
                                                                            "limits": {"memory": "32Gi"}}}))
        assert trainers[0]["containers"][0]["resources"] == {
            "requests": {"cpu": "16", "memory": "200Gi", "nvidia.com/gpu": "4"},
            "limits": {"memory": "200Gi", "nvidia.com/gpu": "4"}}
        assert rollout["containers"][0]["resources"] == {
            "requests": {"cpu": "4", "nvidia.com/gpu": "2"}, "limits": {"memory": "32Gi", "nvidia.com/gpu": "2"}}

    @pytest.mark.parametrize("resources, message", [
        ({"requests": {"nvidia.com/gpu": 8}}, "nvidia.com/gpu is set from trainer.nprocPerNode"),
        ({"requests": {"memory": "lots"}}, "'lots' is not a Kubernetes quantity"),
        ({"limits": {"cpu": True}}, "must be a Kubernetes quantity"),
    ])
    def test_bad_resources_are_refused_with_the_field(self, resources, message):
        with pytest.raises(JobError) as err:
            validate_job(job_data(trainer={"resources": resources}))
        assert message in str(err.value) and "spec.trainer.resources" in str(err.value)


class TestVolumes:
    def test_output_claim_is_mounted_at_the_output_dir_of_trainer_pods_only(self):
        rollout, trainers, _ = pods_of(job_data(output={"dir": "/ckpt", "claimName": "runs"}))
        for pod in trainers:
            assert {"name": "output", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
            assert {"name": "output", "mountPath": "/ckpt"} in pod["containers"][0]["volumeMounts"]
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["RLHF_OUTPUT_DIR"] == "/ckpt"
        assert all(v["name"] != "output" for v in rollout["volumes"])

    def test_default_output_dir_with_a_claim(self):
        _, trainers, _ = pods_of(job_data(output={"claimName": "runs"}))
        assert {"name": "output", "mountPath": "/output"} in trainers[0]["containers"][0]["volumeMounts"]

    @pytest.mark.parametrize("change, field", [
        ({"model": "/models/qwen"}, "spec.model.path: '/models/qwen' is on no mounted volume"),
        ({"data": "data/train.jsonl"}, "spec.data.path: 'data/train.jsonl' is on no mounted volume"),
        ({"output": {"dir": "/output"}}, "spec.output.dir: '/output' is on no mounted volume"),
        ({"output": {}}, "spec.output.dir: '/output' is on no mounted volume"),  # the default
        ({"pod": {**POD, "volumeMounts": [{"name": "work", "mountPath": "/work", "readOnly": True}]}},
         "spec.output.dir: '/work/runs/demo' is on the read-only mount '/work'"),
        ({"pod": {**POD, "volumeMounts": [{"name": "work", "mountPath": "/workspace"}]}},
         "spec.model.path: '/work/models/qwen' is on no mounted volume"),  # a prefix is not a parent
    ])
    def test_paths_on_no_mounted_volume_are_refused(self, change, field):
        with pytest.raises(PodSettingsError) as err:
            PodSettings.from_job(validate_job(job_data(**change)))
        assert field in str(err.value)

    def test_an_s3_output_needs_no_volume_the_trainer_gets_an_empty_dir(self):
        """`output.uri` without a claim: the trainer pods write into an emptyDir at the output
        directory (the download step restores the bucket's newest checkpoint into it first);
        the rollout pods do not get it."""
        job = job_data(pod={}, model="hf://org/tiny", data="hf://org/prompts",
                       output={"uri": "s3://team-runs/demo"}, trainer={"numNodes": 1, "nprocPerNode": 4})
        settings = PodSettings.from_job(validate_job(job))
        assert settings.output_scratch and settings.output_claim is None
        rollout, trainers, _ = pods_of(job)
        for pod in trainers:
            assert {"name": "output", "emptyDir": {}} in pod["volumes"]
            for container in [*pod["containers"], *pod["initContainers"]]:  # the download step writes there too
                assert {"name": "output", "mountPath": "/output"} in container["volumeMounts"]
            fetch = pod["initContainers"][0]["command"]
            assert "--restore" in fetch and fetch[fetch.index("--restore") + 1] == "s3://team-runs/demo"
        assert all(v["name"] != "output" for v in rollout["volumes"])
        # a claim, or a mount of the user's, is still used when given (no emptyDir over it)
        with_claim = PodSettings.from_job(validate_job({**job, "spec": {**job["spec"], "output": {
            "uri": "s3://team-runs/demo", "claimName": "runs"}}}))
        assert with_claim.output_claim == "runs" and not with_claim.output_scratch
        on_mount = PodSettings.from_job(validate_job(job_data(output={"dir": "/work/o", "uri": "s3://team-runs/p"},
                                                              trainer={"numNodes": 1})))
        assert not on_mount.output_scratch

    def test_an_s3_output_on_several_nodes_needs_a_shared_volume(self):
        with pytest.raises(PodSettingsError) as err:
            PodSettings.from_job(validate_job(job_data(pod={}, model="hf://org/tiny", data="hf://org/prompts",
                                                       output={"uri": "s3://team-runs/demo"})))
        assert "spec.output.claimName" in str(err.value) and "trainer.numNodes (2) > 1" in str(err.value)

    def test_builtin_paths_need_no_volume(self):
        job = validate_job(job_data(pod={}, model="builtin://tiny-qwen2", data="builtin://last-digit",
                                    output={"claimName": "runs"}))
        assert PodSettings.from_job(job).output_claim == "runs"

    def test_a_mount_must_name_a_volume(self):
        with pytest.raises(JobError, match=r"spec.pod: volumeMounts\[0\]\.name: 'wrok' is not a volume in pod.volumes"):
            validate_job(job_data(pod={**POD, "volumeMounts": [{"name": "wrok", "mountPath": "/work"}]}))

    def test_the_output_volume_name_is_reserved_with_a_claim(self):
        pod = {**POD, "volumes": [{"name": "output", "emptyDir": {}}, *POD["volumes"]]}
        with pytest.raises(PodSettingsError, match="spec.pod.volumes: the name 'output' is taken"):
            PodSettings.from_job(validate_job(job_data(pod=pod, output={"dir": "/work/o", "claimName": "runs"})))

    def test_the_operators_own_volume_names_are_refused(self):
        pod = {**POD, "volumes": [*POD["volumes"], {"name": "scratch", "emptyDir": {}}]}
        with pytest.raises(PodSettingsError, match="spec.pod.volumes: the name.s. scratch are the operator's own"):
            PodSettings.from_job(validate_job(job_data(pod=pod)))

    def test_the_old_annotation_is_refused_with_where_its_keys_go(self):
        data = job_data()
        data["metadata"]["annotations"] = {"rlhf.dev/pod-settings": '{"nodeSelector": {}}'}
        with pytest.raises(PodSettingsError, match=r"no longer read: move its keys to spec.pod"):
            PodSettings.from_job(validate_job(data))


class TestEnvironment:
    ENV = [{"name": "NCCL_DEBUG", "value": "INFO"},
           {"name": "MLFLOW_TRACKING_TOKEN", "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}}]

    def test_pod_env_env_from_and_the_wandb_key_reach_trainers_and_servers_not_the_sandbox(self):
        pod = {**POD, "env": self.ENV, "envFrom": [{"secretRef": {"name": "nccl-settings"}}]}
        data = job_data(pod=pod, reward={"type": "code"},
                        tracking={"wandb": {"project": "rl", "apiKeySecret": {"name": "wandb", "key": "api-key"},
                                            "baseUrl": "https://wandb.example.com"}})
        rollout, trainers, _ = pods_of(data)
        for spec in [rollout, *trainers]:
            [c] = spec["containers"]
            assert all(e in c["env"] for e in self.ENV) and c["envFrom"] == [{"secretRef": {"name": "nccl-settings"}}]
        for spec in trainers:  # the key only where rank 0 logs
            env = {e["name"]: e for e in spec["containers"][0]["env"]}
            assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
            assert env["WANDB_BASE_URL"]["value"] == "https://wandb.example.com"
        assert "WANDB_API_KEY" not in {e["name"] for e in rollout["containers"][0]["env"]}
        sandbox = next(c for c in build_children(validate_job(data), 0) if c["kind"] == "StatefulSet"
                       and c["metadata"]["name"].endswith("-sandbox"))
        [box] = sandbox["spec"]["template"]["spec"]["containers"]
        assert "envFrom" not in box and not {"NCCL_DEBUG", "MLFLOW_TRACKING_TOKEN"} & {e["name"] for e in box["env"]}
        api = ApiClient()  # real Kubernetes objects
        for spec in [rollout, *trainers]:
            assert api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(spec), "V1PodSpec")) == spec

    @pytest.mark.parametrize("backend", ["PyTorchJob", "JobSet"])
    def test_nccl_bootstraps_on_the_pod_network_on_both_sides_of_the_weight_sync(self, backend):
        """Trainer and rollout servers pin one NCCL interface (contract.NCCL_SOCKET_IFNAME),
        and a spec.pod.env entry replaces it everywhere, once (no duplicate name)."""
        def containers(data) -> dict[str, list[dict]]:
            found: dict[str, list[dict]] = {}

            def walk(node):
                if isinstance(node, dict):
                    for c in node.get("containers", []):
                        found.setdefault(c["name"], []).append(c)
                    for value in node.values():
                        walk(value)
                elif isinstance(node, list):
                    for value in node:
                        walk(value)
            walk([c for c in build_children(validate_job(data), 0) if "sandbox" not in c["metadata"]["name"]])
            return found

        def ifnames(c: dict) -> list[str]:
            return [e.get("value") for e in c["env"] if e["name"] == "NCCL_SOCKET_IFNAME"]

        default = containers(job_data(backend=backend, rollout={"replicas": 2, "engine": "vllm"}))
        assert set(default) == {"server", "pytorch" if backend == "PyTorchJob" else "trainer"}
        assert all(ifnames(c) == ["eth0"] for cs in default.values() for c in cs)
        pod = {**POD, "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "net1"}]}
        pinned = containers(job_data(pod=pod, backend=backend, rollout={"replicas": 2, "engine": "vllm"}))
        assert all(ifnames(c) == ["net1"] for cs in pinned.values() for c in cs)

    @pytest.mark.parametrize("network, wanted", [("socket", {"NCCL_NET": ["Socket"], "NCCL_IB_DISABLE": ["1"]}),
                                                 ("ib", {"NCCL_NET": ["IB"], "NCCL_IB_DISABLE": []}),
                                                 ("auto", {"NCCL_NET": [], "NCCL_IB_DISABLE": []})])
    def test_the_weight_sync_network_is_pinned_in_the_trainer_and_the_server_pods(self, network, wanted):
        """rollout.weightSyncNetwork pins NCCL's transport (not only its interface) on both
        sides: NCCL_NET in every trainer and server container, once, and a pod.env entry
        that agrees replaces ours (one entry of each name)."""
        def env_of(data) -> list[tuple[str, dict[str, list[str]]]]:
            """(container name, the values of NCCL_NET and NCCL_IB_DISABLE) of every container."""
            pods = [c for c in build_children(validate_job(data), 0) if "sandbox" not in c["metadata"]["name"]]
            return [(c["name"], {name: [e.get("value") for e in c["env"] if e["name"] == name]
                                 for name in ("NCCL_NET", "NCCL_IB_DISABLE")})
                    for child in pods for c in _containers(child)]

        rollout = {"replicas": 2, "engine": "vllm", "weightSyncNetwork": network}
        found = env_of(job_data(rollout=rollout))
        assert {name for name, _ in found} == {"server", "pytorch"}
        assert all(env == wanted for _, env in found), found
        if network == "socket":
            agreeing = {**POD, "env": [{"name": "NCCL_NET", "value": "socket"}]}
            found = env_of(job_data(pod=agreeing, rollout=rollout))
            assert all(env == {"NCCL_NET": ["socket"], "NCCL_IB_DISABLE": ["1"]} for _, env in found), found

    @pytest.mark.parametrize("network, entry", [("socket", {"name": "NCCL_NET", "value": "IB"}),
                                                ("ib", {"name": "NCCL_NET", "value": "Socket"}),
                                                ("ib", {"name": "NCCL_IB_DISABLE", "value": "1"}),
                                                ("socket", {"name": "NCCL_IB_DISABLE", "value": "0"})])
    def test_a_pod_env_entry_contradicting_the_weight_sync_network_is_refused_naming_both(self, network, entry):
        data = job_data(pod={**POD, "env": [entry]}, rollout={"replicas": 2, "engine": "vllm",
                                                               "weightSyncNetwork": network})
        with pytest.raises(JobError, match=rf"spec\.pod\.env\[0\]: {entry['name']}={entry['value']} contradicts "
                                           rf"spec\.rollout\.weightSyncNetwork: {network}"):
            validate_job(data)
        validate_job(job_data(pod={**POD, "env": [entry]}, rollout={"replicas": 2, "engine": "vllm"}))  # auto: pod.env decides

    def test_env_names_the_operator_sets_are_refused(self):
        with pytest.raises(JobError, match=r"env\[0\]\.name: RLHF_OUTPUT_DIR is set by the operator"):
            validate_job(job_data(pod={**POD, "env": [{"name": "RLHF_OUTPUT_DIR", "value": "/x"}]}))

    def test_a_code_component_gets_the_sandbox_service(self):
        data = job_data(reward={"type": "math", "components": [{"name": "tests", "type": "code", "weight": 0.5}]})
        names = {c["metadata"]["name"] for c in build_children(validate_job(data), 0)}
        assert "demo-sandbox" in names


def _containers(node) -> list[dict]:
    """Every container of a built object, however deep its pod template lies."""
    if isinstance(node, dict):
        return list(node.get("containers", [])) + [c for v in node.values() for c in _containers(v)]
    if isinstance(node, list):
        return [c for v in node for c in _containers(v)]
    return []
