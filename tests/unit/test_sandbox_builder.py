"""The sandbox children of a job with a code reward: the Kubernetes models accept them, the pod
is at the `restricted` level and holds no token, and the network lets only the job's trainer in
and nothing out (and the job's own NetworkPolicy does not let the sandbox reach the trainer)."""

from __future__ import annotations

import copy

import pytest

from rlhf_contract import sandbox as contract
from rlhf_contract.api import validate_job
from rlhf_contract.api.models import RewardSpec
from rlhf_operator.backends import build_children
from rlhf_operator.builders import LABEL_JOB, LABEL_ROLE, ROLE_TRAINER

from test_builders import make_job, roundtrip


def children(service=None, **reward):
    data = make_job(reward={"type": "code", **reward})
    if service is not None:
        data["spec"]["sandboxService"] = service
    job = validate_job(copy.deepcopy(data))
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(job, 0)}


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_code_reward_gets_a_sandbox_and_other_rewards_do_not():
    kids = children()
    for kind in ("StatefulSet", "Service", "NetworkPolicy"):
        assert (kind, "demo-sandbox") in kids
    roundtrip(kids[("StatefulSet", "demo-sandbox")], "V1StatefulSet")
    roundtrip(kids[("Service", "demo-sandbox")], "V1Service")
    roundtrip(kids[("NetworkPolicy", "demo-sandbox")], "V1NetworkPolicy")
    plain = validate_job(make_job())
    assert not [c for c in build_children(plain, 0) if c["metadata"]["name"] == "demo-sandbox"]
    external = children(sandbox={"url": "http://sandbox.shared:8080"})
    assert ("StatefulSet", "demo-sandbox") not in external


def test_sandbox_pod_is_restricted_without_token_or_data():
    sts = children()[("StatefulSet", "demo-sandbox")]
    pod = sts["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    csc = c["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}
    assert csc["readOnlyRootFilesystem"] is True and not csc.get("privileged")
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert pod["enableServiceLinks"] is False
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "2Gi"}}]  # no data, config, output
    assert c["command"] == contract.sandbox_command()
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "4", "memory": "12Gi"}
    assert c["image"] == "ghcr.io/rlhf-operator/trainer:0.1.0"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert LABEL_JOB not in labels and selects(sts["spec"]["selector"], labels)


def test_network_only_trainer_in_nothing_out():
    kids = children()
    pod_labels = kids[("StatefulSet", "demo-sandbox")]["spec"]["template"]["metadata"]["labels"]
    policy = kids[("NetworkPolicy", "demo-sandbox")]["spec"]
    assert selects(policy["podSelector"], pod_labels)
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": contract.SANDBOX_PORT, "protocol": "TCP"}]
    (peer,) = rule["from"]
    ptj = kids[("PyTorchJob", "demo-trainer")]
    trainer_labels = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert selects(peer["podSelector"], trainer_labels)
    rollout_labels = kids[("StatefulSet", "demo-rollout")]["spec"]["template"]["metadata"]["labels"]
    assert not selects(peer["podSelector"], rollout_labels)
    assert peer["podSelector"]["matchLabels"] == {LABEL_JOB: "demo", LABEL_ROLE: ROLE_TRAINER}
    # the job's own policy admits its pods to every port of the trainer and the rollout servers:
    # the sandbox pods must not be among them
    job_policy = kids[("NetworkPolicy", "demo")]["spec"]
    for source in job_policy["ingress"][0]["from"]:
        assert not selects(source["podSelector"], pod_labels)
    service = kids[("Service", "demo-sandbox")]["spec"]
    assert selects({"matchLabels": service["selector"]}, pod_labels)


def test_sandbox_settings_reach_the_pod():
    kids = children(requireSandboxIsolation=False,
                    service={"replicas": 3, "cpu": "500m", "memory": "2Gi",
                             "seccompLocalhostProfile": "profiles/userns.json"})
    sts = kids[("StatefulSet", "demo-sandbox")]
    pod = sts["spec"]["template"]["spec"]
    assert sts["spec"]["replicas"] == 3
    localhost = {"type": "Localhost", "localhostProfile": "profiles/userns.json"}
    assert pod["securityContext"]["seccompProfile"] == localhost
    assert pod["containers"][0]["securityContext"]["seccompProfile"] == localhost
    assert pod["containers"][0]["command"][-1] == "--allow-rlimits-only"
    assert pod["containers"][0]["resources"]["limits"] == {"cpu": "500m", "memory": "2Gi"}


def test_reward_spec_sandbox_fields_and_errors_name_the_field():
    spec = RewardSpec.model_validate({"type": "code", "sandbox": {"memoryMb": 256, "maxProcesses": 2}})
    assert spec.sandbox.memory_mb == 256 and spec.sandbox.max_processes == 2
    for bad, field in (({"memoryMb": 1}, "sandbox.memoryMb"), ({"url": "ftp://x"}, "sandbox.url"),
                       ({"maxProcesses": 0}, "sandbox.maxProcesses")):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            RewardSpec.model_validate({"type": "code", "sandbox": bad})
    for bad, field in (({"cpu": "lots"}, "sandboxService.cpu"), ({"replicas": 0}, "sandboxService.replicas")):
        data = make_job(reward={"type": "code"})
        data["spec"]["sandboxService"] = bad
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            validate_job(data)
    assert contract.sandbox_url("demo", "team-a") == "http://demo-sandbox.team-a.svc:8080"
