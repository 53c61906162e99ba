"""The download step in the pods: an init container `fetch` (the trainer image, running
`python -m rlhf_trainer.storage`, rlhf_contract.pod.fetch_process) on every pod that reads
an `hf://` / `s3://` model or dataset (the trainer pods: all of them, and the bucket's
newest checkpoint with `output.uri`; the rollout servers: the model), and the Secret wiring
of `spec.storageSecret` (envFrom into the init container and the trainer, never into the
rollout server's own container or the sandbox pods). The init container also gets
`spec.pod.env` and `spec.pod.envFrom` (proxies, HF_XET_HIGH_PERFORMANCE, AWS_REGION, a CA
bundle's path), after the Secret, as the trainer container does.

Where the copies land: `<output dir>/sources` (rlhf_contract.sources). On the trainer pods
that is the output volume, so a restart downloads nothing again. A rollout pod whose
output directory is on no volume it mounts gets an emptyDir there (its model is then
downloaded once per pod: give `spec.pod.volumeMounts` a shared volume holding the output
directory to download once per job)."""

from __future__ import annotations

import copy
from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.sources import ENV_STORAGE_SECRET, SOURCES_DIR, plan

from .meta import ROLE_ROLLOUT, ROLE_TRAINER
from .pods import PodSettings, mount_of, container_security_context, env_list, output_dir

SOURCES_VOLUME = "sources"
FETCH_CONTAINER = "fetch"


def secret_env(job: RLHFJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, envFrom) that give a container `spec.storageSecret` (empty without one)."""
    secret = job.spec.storage_secret
    if not secret:
        return [], []
    return [{"name": ENV_STORAGE_SECRET, "value": secret}], [{"secretRef": {"name": secret}}]


def _rollout_needs_volume(job: RLHFJob, settings: PodSettings) -> bool:
    return bool(plan(job, output_dir(job), model_only=True)) and mount_of(
        f"{output_dir(job)}/{SOURCES_DIR}", settings.volume_mounts) is None


def with_storage(job: RLHFJob, settings: PodSettings, spec: dict[str, Any], *, trainer: bool) -> dict[str, Any]:
    """The pod spec with the download step (and a rollout pod's sources volume) added in place."""
    out = output_dir(job)
    restore = job.spec.output.uri if trainer else None
    proc = contract.fetch_process(plan(job, out, model_only=not trainer), restore_uri=restore, output_dir=out)
    if proc is None:
        return spec
    main = spec["containers"][0]
    if not trainer and _rollout_needs_volume(job, settings):
        spec["volumes"].append({"name": SOURCES_VOLUME, "emptyDir": {}})
        main["volumeMounts"].append({"name": SOURCES_VOLUME, "mountPath": f"{out}/{SOURCES_DIR}"})
    env, env_from = secret_env(job)
    resources = copy.deepcopy(main["resources"])
    accelerator = settings.role(ROLE_TRAINER if trainer else ROLE_ROLLOUT).accelerator_resource
    for part in resources.values():  # the download step needs no accelerator
        part.pop(accelerator, None)
    init = {
        "name": FETCH_CONTAINER,
        "image": job.spec.trainer.image,
        "command": proc.command,
        "env": env_list(proc.env) + env + list(job.spec.pod.env),
        "resources": resources,
        "securityContext": container_security_context(),
        "volumeMounts": copy.deepcopy(main["volumeMounts"]),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    env_from = env_from + list(job.spec.pod.env_from)
    if env_from:
        init["envFrom"] = env_from
    spec["initContainers"] = [init]
    return spec
