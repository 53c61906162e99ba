"""The judge servers a job with `reward.type: judge` and no `judge.url` gets
(operator/rlhf_operator/builders/judge.py), as `rlhfctl render` prints them, checked against
the Kubernetes models; the trainer's judge environment; a judge at a URL gets no servers."""

from __future__ import annotations

import copy

import pytest
import yaml

from rlhf_contract.api import JobError, validate_job
from rlhf_launcher.cli import main as rlhfctl

from test_builders import make_job, roundtrip
from test_sandbox_builder import selects

JUDGE = {"name": "judge", "type": "judge", "weight": 0.5, "judge": {"model": "/models/judge-7b", "replicas": 2}}


def rendered(tmp_path, capsys, components) -> dict:
    data = make_job(reward={"type": "math", "components": components})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert rlhfctl(["render", str(path)]) == 0
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(capsys.readouterr().out)}


def trainer_env(kids: dict) -> dict:
    master = kids[("PyTorchJob", "demo-trainer")]["spec"]["pytorchReplicaSpecs"]["Master"]
    return {e["name"]: e for e in master["template"]["spec"]["containers"][0]["env"]}


def test_render_shows_the_judge_servers_and_the_trainer_finds_them(tmp_path, capsys):
    kids = rendered(tmp_path, capsys, [JUDGE])
    sts, svc, policy = (kids[(k, "demo-judge")] for k in ("StatefulSet", "Service", "NetworkPolicy"))
    for obj, klass in ((sts, "V1StatefulSet"), (svc, "V1Service"), (policy, "V1NetworkPolicy")):
        roundtrip(obj, klass)
    pod = sts["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert sts["spec"]["replicas"] == 2
    assert container["command"][:3] == ["vllm", "serve", "/models/judge-7b"]
    assert "--served-model-name" in container["command"] and "judge" in container["command"]
    assert "--weight-transfer-config" not in container["command"]  # a frozen model
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"  # the rollout servers' tensorParallelSize
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod["metadata"]["labels"])
    assert "rlhf.dev/job" not in pod["metadata"]["labels"]  # not a pod of the job's phase
    assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["rlhf.dev/role"] == "trainer"
    env = trainer_env(kids)
    assert env["RLHF_JUDGE_ENDPOINTS"]["value"] == "http://demo-judge.team-a.svc:8000"
    assert "RLHF_JUDGE_API_KEY" not in env


def test_a_judge_at_a_url_gets_its_key_and_no_servers(tmp_path, capsys):
    external = copy.deepcopy(JUDGE)
    external["judge"] = {"url": "https://api.example.com/v1", "model": "grader-large",
                         "apiKeySecret": {"name": "judge-key", "key": "token"}}
    kids = rendered(tmp_path, capsys, [external])
    assert not [k for k in kids if k[1] == "demo-judge"]
    env = trainer_env(kids)
    assert env["RLHF_JUDGE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "judge-key", "key": "token"}}
    assert "RLHF_JUDGE_ENDPOINTS" not in env


def test_one_served_judge_model_per_job():
    other = copy.deepcopy(JUDGE)
    other.update(name="judge2")
    other["judge"]["model"] = "/models/other"
    with pytest.raises(JobError, match=r"spec.reward: judges without judge.url must all name the same judge.model"):
        validate_job(make_job(reward={"type": "math", "components": [JUDGE, other]}))
    with pytest.raises(JobError, match=r"spec.reward.components: each component of type judge needs judge"):
        validate_job(make_job(reward={"type": "math", "components": [{"name": "j", "type": "judge"}]}))
