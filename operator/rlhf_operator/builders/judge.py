"""The judge servers of a job with `reward.type: judge` and no `judge.url` (any reward function):
`judge.model` served by vLLM (the CPU engine for `rollout.engine: cpu`), apart from the
rollout servers, for as long as the job lives (a frozen model: restarts keep them).

  StatefulSet `<job>-judge`    `judge.replicas` pods of `rollout.image` running
                               `pod.judge_process` (the rollout servers' GPUs per replica,
                               resources, volumes and pod settings), answering to the model
                               name `judge`; no weight transfer.
  Service `<job>-judge`        ClusterIP, port 8000, spread over the replicas: the trainer's
                               RLHF_JUDGE_ENDPOINTS.
  NetworkPolicy `<job>-judge`  ingress only from this job's trainer pods on 8000.

The judge pods carry `rlhf.dev/judge-of: <job>`, not `rlhf.dev/job` (as the sandbox's): the
job's phase and failures are its rollout servers' and trainers'; a judge pod that is down
shows in the trainer's log as a judge request that failed its retries (then the job restarts),
and the trainer waits for the judge's /health before its first step.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from .meta import LABEL_JOB, LABEL_ROLE, ROLE_ROLLOUT, ROLE_TRAINER, http_service, metadata, namespace_of
from .pods import PodSettings, container_resources, container_security_context, env_list, pod_spec, volume_mounts

LABEL_JUDGE_OF = "rlhf.dev/judge-of"


def judge_name(job: str) -> str:
    return f"{job}-judge"


def judge_endpoints(job: RLHFJob) -> list[str]:
    """The judge Service's base URL (none when the job serves no judge)."""
    if contract.served_judge(job.spec) is None:
        return []
    return [f"http://{judge_name(job.metadata.name)}.{namespace_of(job)}.svc:{contract.ROLLOUT_PORT}"]


def judge_pod_labels(job: RLHFJob) -> dict[str, str]:
    return {LABEL_JUDGE_OF: job.metadata.name}


def build_judge_statefulset(job: RLHFJob, settings: PodSettings) -> dict[str, Any]:
    r, judge = job.spec.rollout, contract.served_judge(job.spec)
    proc = contract.judge_process(job, host="0.0.0.0", port=contract.ROLLOUT_PORT)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container = {
        "name": "judge",
        "image": r.image,
        "command": proc.command,
        "env": env_list(proc.env) + list(job.spec.pod.env),
        "ports": [{"name": "http", "containerPort": contract.ROLLOUT_PORT, "protocol": "TCP"}],
        "resources": container_resources(r.gpus_per_server, r.resources, settings.role(ROLE_ROLLOUT)),
        "securityContext": container_security_context(),
        "volumeMounts": volume_mounts(settings),
        "startupProbe": {**probe, "periodSeconds": contract.ROLLOUT_STARTUP_PROBE_PERIOD_S,
                         "failureThreshold": contract.startup_probe_failures(job.spec)},
        "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 30, "failureThreshold": 4},
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if job.spec.pod.env_from:
        container["envFrom"] = list(job.spec.pod.env_from)
    name = judge_name(job.metadata.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(job, name),
        "spec": {
            "serviceName": name,
            "replicas": judge.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": judge_pod_labels(job)},
            "template": {"metadata": {"labels": judge_pod_labels(job)},
                         "spec": pod_spec(job, settings, [container], role=ROLE_ROLLOUT, restart_policy="Always",
                                          service_account=None)},
        },
    }


def build_judge_service(job: RLHFJob) -> dict[str, Any]:
    return http_service(job, judge_name(job.metadata.name), judge_pod_labels(job), contract.ROLLOUT_PORT)


def build_judge_network_policy(job: RLHFJob) -> dict[str, Any]:
    trainers = {"podSelector": {"matchLabels": {LABEL_JOB: job.metadata.name, LABEL_ROLE: ROLE_TRAINER}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, judge_name(job.metadata.name)),
        "spec": {
            "podSelector": {"matchLabels": judge_pod_labels(job)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [trainers], "ports": [{"port": contract.ROLLOUT_PORT, "protocol": "TCP"}]}],
        },
    }


def build_judge(job: RLHFJob, settings: PodSettings) -> list[dict[str, Any]]:
    """The judge children of `job` (none unless it serves a judge)."""
    if contract.served_judge(job.spec) is None:
        return []
    return [build_judge_network_policy(job), build_judge_service(job), build_judge_statefulset(job, settings)]


def judge_env(job: RLHFJob) -> list[dict[str, Any]]:
    """The trainer's judge settings: its own judge servers, and a judge URL's key from its Secret."""
    env: list[dict[str, Any]] = []
    if judge_endpoints(job):
        env.append({"name": contract.ENV_JUDGE_ENDPOINTS, "value": ",".join(judge_endpoints(job))})
    refs = [f.judge.api_key_secret for f in job.spec.reward.functions()
            if f.type == "judge" and f.judge is not None and f.judge.url and f.judge.api_key_secret is not None]
    if refs and not job.spec.offline:
        env.append({"name": contract.ENV_JUDGE_API_KEY,
                    "valueFrom": {"secretKeyRef": {"name": refs[0].name, "key": refs[0].key}}})
    return env
