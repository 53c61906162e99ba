"""The parts of the workloads every backend shares: the rollout StatefulSet, the rollout
and trainer containers. The backends' own workloads (the trainer PyTorchJob, the JobSet,
the TrainJob) are built in backends/.

Both take their commands and environment from the pod contract (rlhf_contract/pod.py). Pods of
attempt N carry `rlhf.dev/attempt: N`; a restart deletes both workloads, waits until every
pod of the job is gone, and builds them again with N + 1.

Rollout servers: one pod per server, `tensorParallelSize` GPUs each, stable DNS names
`<job>-rollout-<i>.<job>-rollout.<ns>.svc` through the headless Service; updateStrategy
OnDelete so that a spec change never rolls servers under a running trainer.
Trainer: `trainer_container`, which each backend puts in its own workload.
"""

from __future__ import annotations

from typing import Any

from rlhf_contract import images, pod as contract
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.sources import localize
from .meta import (
    LABEL_ATTEMPT, LABEL_JOB, LABEL_ROLE, RJOB_ROLLOUT, ROLE_ROLLOUT, ROLE_TRAINER, job_labels, jobset_name, metadata,
    namespace_of, pod_labels, rollout_name, trainer_name, weight_sync_name,
)
from .judge import judge_env
from .storage import secret_env, with_storage
from .pods import (
    CONFIG_PATH, PodSettings, container_resources, container_security_context, env_list, output_dir, pod_spec,
    template_metadata, volume_mounts,
)

HEALTH_PATH = "/health"


def trainer_image(job: RLHFJob) -> str:
    """The trainer pods' image: `trainer.image`; for colocated placement the image that holds
    the trainer and the pinned vLLM side by side (images.COLOCATED_IMAGE) unless
    `trainer.image` names another than the default."""
    t = job.spec.trainer
    if job.spec.rollout.placement == "colocated" and not job.spec.offline and t.image == images.TRAINER_IMAGE:
        return images.COLOCATED_IMAGE
    return t.image


def rollout_endpoints(job: RLHFJob) -> list[str]:
    """Base URLs of the rollout servers: the StatefulSet pods' stable DNS names (none for
    the offline methods, or colocated servers). A backend that runs the servers in its own
    workload has its own (`backends.rollout_endpoints` picks)."""
    if job.spec.trainer_pods_only:  # colocated: each trainer pod's own, on loopback (contract.colocated_trainer_process)
        return []
    ns = namespace_of(job)
    name = rollout_name(job.metadata.name)
    return [f"http://{name}-{i}.{name}.{ns}.svc:{contract.ROLLOUT_PORT}" for i in range(job.spec.rollout.replicas)]


def weight_sync_addr(job: RLHFJob) -> str:
    return f"{weight_sync_name(job.metadata.name)}.{namespace_of(job)}.svc:{contract.WEIGHT_SYNC_PORT}"


def _probe(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
    return {"httpGet": {"path": HEALTH_PATH, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def rollout_container(job: RLHFJob, settings: PodSettings) -> dict[str, Any]:
    """The rollout server's container (both backends)."""
    r = job.spec.rollout
    proc = contract.rollout_process(job, model_path=localize(job, output_dir(job)).spec.model.path, host="0.0.0.0",
                                    port=contract.ROLLOUT_PORT)
    container = {
        "name": "server",
        "image": r.image,
        "command": proc.command,
        "env": env_list({**proc.env, **nccl_network_env(job)}) + list(job.spec.pod.env),
        "ports": [{"name": "http", "containerPort": contract.ROLLOUT_PORT, "protocol": "TCP"}],
        "resources": container_resources(r.gpus_per_server, r.resources, settings.role(ROLE_ROLLOUT)),
        "securityContext": container_security_context(),
        "volumeMounts": volume_mounts(settings),
        # Loading a large model takes minutes: up to 30 min before liveness applies.
        # as long as rollout.startupTimeoutSeconds (the trainer waits the same time)
        "startupProbe": _probe(period=contract.ROLLOUT_STARTUP_PROBE_PERIOD_S,
                               failures=contract.startup_probe_failures(job.spec)),
        "readinessProbe": _probe(period=10, failures=3),
        "livenessProbe": _probe(period=30, failures=4, timeout=10),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if job.spec.pod.env_from:
        container["envFrom"] = list(job.spec.pod.env_from)
    return container


def nccl_network_env(job: RLHFJob) -> dict[str, str]:
    """NCCL's network settings, the same in the trainer's and the rollout servers' pods:
    the bootstrap interface (`contract.NCCL_SOCKET_IFNAME`, why there) and the transport
    `rollout.weightSyncNetwork` pins (`contract.weight_sync_network_env`: NCCL_NET, and
    NCCL_IB_DISABLE for socket), each unless `spec.pod.env` sets that name: then the user's
    entry is the only one (a duplicate name would fail server-side apply; a contradicting
    one is refused by the spec's validation)."""
    env = {contract.ENV_NCCL_SOCKET_IFNAME: contract.NCCL_SOCKET_IFNAME,
           **contract.weight_sync_network_env(job.spec.rollout.weight_sync_network)}
    user = {e.get("name") for e in job.spec.pod.env}
    return {name: value for name, value in env.items() if name not in user}


def rollout_service_account(job: RLHFJob, settings: PodSettings) -> str | None:
    """The rollout servers' ServiceAccount: their own when it carries annotations (cloud
    IAM), else none (the namespace's default, without a token)."""
    return rollout_name(job.metadata.name) if settings.role(ROLE_ROLLOUT).service_account_annotations else None


def tracking_env(job: RLHFJob) -> list[dict[str, Any]]:
    """The trackers' settings that come from the cluster: W&B's key from its Secret."""
    wandb = job.spec.tracking.wandb
    env: list[dict[str, Any]] = []
    if wandb is not None and wandb.api_key_secret is not None:
        ref = wandb.api_key_secret
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if wandb is not None and wandb.base_url:
        env.append({"name": "WANDB_BASE_URL", "value": wandb.base_url})
    return env


def build_rollout_statefulset(job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
    r = job.spec.rollout
    container = rollout_container(job, settings)
    name = rollout_name(job.metadata.name)
    labels = pod_labels(job, ROLE_ROLLOUT, attempt)
    selector = {LABEL_JOB: labels[LABEL_JOB], LABEL_ROLE: ROLE_ROLLOUT}  # immutable: only stable labels
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(job, name, {**job_labels(job), LABEL_ATTEMPT: str(attempt)}),
        "spec": {
            "serviceName": name,
            "replicas": r.replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": template_metadata(labels, settings.role(ROLE_ROLLOUT)),
                "spec": with_storage(job, settings, pod_spec(job, settings, [container], role=ROLE_ROLLOUT,
                                                             restart_policy="Always",
                                                             service_account=rollout_service_account(job, settings),
                                                             automount_token=False), trainer=False),
            },
        },
    }


def _log_env(attempt_label: str) -> list[dict[str, Any]]:
    """The pod's name and attempt, by the downward API: where the trainer keeps its log."""
    return [{"name": contract.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": contract.ENV_ATTEMPT, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{attempt_label}']"}}}]


def trainer_container(job: RLHFJob, settings: PodSettings, *, rollout_endpoints: list[str], weight_sync_addr: str,
                      name: str = "pytorch", extra_env: list[dict[str, Any]] = (),
                      attempt_label: str = LABEL_ATTEMPT) -> dict[str, Any]:
    """The trainer node's container (every backend; `attempt_label`: the pod label that holds
    its attempt, read into RLHF_ATTEMPT so that the pod keeps its log under that attempt)."""
    t = job.spec.trainer
    if job.spec.rollout.placement == "colocated" and not job.spec.offline:
        proc = contract.colocated_trainer_process(
            job, model_path=localize(job, output_dir(job)).spec.model.path, config_path=CONFIG_PATH,
            output_dir=output_dir(job), metrics_port=contract.TRAINER_METRICS_PORT)
    else:
        proc = contract.trainer_process(
            job, config_path=CONFIG_PATH, rollout_endpoints=rollout_endpoints,
            weight_sync_addr=weight_sync_addr, output_dir=output_dir(job), master_addr=None, resume=True,
            metrics_port=contract.TRAINER_METRICS_PORT,
        )
    container = {
        "name": name,
        "image": trainer_image(job),
        "command": proc.command,
        "env": (env_list({**proc.env, **nccl_network_env(job)}) + list(extra_env) + _log_env(attempt_label)
                + tracking_env(job)
                + secret_env(job)[0] + judge_env(job) + list(job.spec.pod.env)),
        "ports": [
            {"name": "pytorchjob-port", "containerPort": contract.TRAINER_MASTER_PORT, "protocol": "TCP"},
            {"name": "weight-sync", "containerPort": contract.WEIGHT_SYNC_PORT, "protocol": "TCP"},
            # every trainer pod answers here; node 0's rank 0 serves the step metrics
            {"name": "metrics", "containerPort": contract.TRAINER_METRICS_PORT, "protocol": "TCP"},
        ],
        "resources": container_resources(t.gpus_per_pod, t.resources, settings.role(ROLE_TRAINER)),
        "securityContext": container_security_context(),
        "volumeMounts": volume_mounts(settings, trainer=True),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    env_from = secret_env(job)[1] + list(job.spec.pod.env_from)  # uploads to output.uri / output.hub
    if env_from:
        container["envFrom"] = env_from
    return container
