"""Secrets never in artefacts: a job whose spec carries literal env values (a token pasted
into `pod.env`) writes none of them into its ConfigMap's `job.json`, its model card or its
TensorBoard config, while its pods still get the real values."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.pod import JOB_FILE, run_config
from rlhf_contract.redact import REDACTED, redact_spec, redact_text
from rlhf_operator.backends import build_children
from rlhf_operator.builders.config import build_config_map
from rlhf_trainer.storage.model_card import write_card

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhfjob.yaml"
SECRET = "hf_s3cr3tT0kenValue"


def _job() -> RLHFJob:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["spec"]["pod"]["env"] = [
        {"name": "HF_TOKEN", "value": SECRET},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}},
    ]
    body["metadata"].update(namespace="team", uid="0b4e8e0c-1f0e-4a55-9a43-6f5f3c1d2e7a")
    return RLHFJob.model_validate(body)


def test_the_config_map_and_the_model_card_hold_no_env_value(tmp_path):
    job = _job()
    data = build_config_map(job)["data"]
    assert SECRET not in json.dumps(data)
    recorded = json.loads(data[JOB_FILE])
    env = recorded["spec"]["pod"]["env"]
    assert env[0] == {"name": "HF_TOKEN", "value": REDACTED}  # the name stays: a reader knows it was set
    assert env[1]["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "key"}

    card = write_card(tmp_path, run_config(job), tmp_path).read_text()
    assert SECRET not in card and "HF_TOKEN" in card

    # the job's own processes still get the value, from the pod spec
    manifests = json.dumps(build_children(job, attempt=0))
    assert SECRET in manifests


def test_tensorboard_logs_the_redacted_spec(tmp_path, monkeypatch):
    from rlhf_contract.api.models import TrackingSpec
    from rlhf_contract.pod import ENV_TRAINER_CONFIG
    from rlhf_trainer.tracking import Trackers

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / JOB_FILE).write_text(json.dumps(run_config(_job())))
    monkeypatch.setenv(ENV_TRAINER_CONFIG, str(tmp_path / "config" / "trainer.json"))
    trackers = Trackers(TrackingSpec.model_validate({}), tmp_path / "out", job_name="demo", resume_step=0)
    trackers.log(1, {"step": 1, "reward_mean": 0.5})
    trackers.close(success=True)
    events = b"".join(p.read_bytes() for p in (tmp_path / "out").rglob("events.out.tfevents.*"))
    assert b"HF_TOKEN" in events and SECRET.encode() not in events


def test_urls_lose_user_info_and_query_strings_and_secret_named_keys_their_values():
    url = "https://bob:pa55@judge.example.com:8443/v1/chat/completions?api_key=k3y#frag"
    assert redact_text(f"POST {url} failed: 503") == \
        f"POST https://{REDACTED}@judge.example.com:8443/v1/chat/completions?{REDACTED}#frag failed: 503"
    assert redact_text("no url here: 5 > 3") == "no url here: 5 > 3"
    assert redact_text("GET http://h/x?token=t: 401.") == f"GET http://h/x?{REDACTED}: 401."  # its colon kept
    spec = {"judge": {"url": url, "apiKeySecret": "judge-key", "apiKey": "sk-live"},
            "tracking": {"mlflow": {"trackingUri": "http://u:p@mlflow:5000"}}, "rollout": {"maxTokens": 64}}
    out = redact_spec(spec)
    assert "pa55" not in json.dumps(out) and "k3y" not in json.dumps(out) and "sk-live" not in json.dumps(out)
    assert out["judge"]["apiKeySecret"] == "judge-key"  # a Secret's name is a reference, not a secret
    assert out["rollout"] == {"maxTokens": 64} and out["tracking"]["mlflow"]["trackingUri"] == f"http://{REDACTED}@mlflow:5000"
    assert spec["judge"]["apiKey"] == "sk-live"  # a copy: the caller's dict is untouched
    servers = {"mcpServers": [{"name": "gh", "command": ["gh-mcp"], "env": {"GITHUB_PAT": "ghp_l1ve", "LOG": "${LOG}"}},
                              {"name": "web", "url": "https://mcp.example.com/mcp",
                               "headers": {"Authorization": "Bearer t0ken", "X-Key": "${MCP_KEY}"}}]}
    out = redact_spec({"rollout": {"tools": servers}})["rollout"]["tools"]["mcpServers"]
    assert out[0]["env"] == {"GITHUB_PAT": REDACTED, "LOG": "${LOG}"}  # names and references stay
    assert out[1]["headers"] == {"Authorization": REDACTED, "X-Key": "${MCP_KEY}"}


def test_the_termination_message_the_operator_copies_into_status_has_no_url_credentials(tmp_path, monkeypatch):
    from rlhf_trainer.exits import write_termination_message

    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setenv("RLHF_TERMINATION_LOG", str(log))
    write_termination_message("ConnectError: https://svc:hunter2@judge.team.svc:8000/v1/chat/completions refused")
    assert "hunter2" not in log.read_text() and "judge.team.svc:8000" in log.read_text()
