"""The download step in the pods: an init container `fetch` (the trainer image, running
`python -m rlhf_trainer.storage`, rlhf_contract.pod.fetch_process) on every pod that reads
an `hf://` / `s3://` model or dataset (the trainer pods: all of them, and the bucket's
newest checkpoint with `output.uri`; the rollout servers: the model), and the Secret wiring
of `spec.storageSecret` (envFrom into the init container and the trainer, never into the
rollout server's own container or the sandbox pods). The init container also gets
`spec.pod.env` and `spec.pod.envFrom` (proxies, HF_XET_HIGH_PERFORMANCE, AWS_REGION, a CA
bundle's path), after the Secret, as the trainer container does.

Where the copies land, so that every pod of a job reads one copy: `<output dir>/sources`
(rlhf_contract.sources), on the volume each role mounts there:
- trainer pods: the output volume (`output.claimName`), so a restart downloads nothing;
- rollout pods, when the output claim is ReadWriteMany (`PodSettings.output_shared`, read by
  the operator from the claim's `spec.accessModes`): the same claim at the output directory,
  writable in the download step (which finds the trainer's copy complete, or downloads it
  once under the same staging, lock and marker rules) and read-only in the server's
  container (it cannot touch checkpoints);
- rollout pods otherwise: what `spec.pod.volumeMounts` mounts there, else an emptyDir at
  `<output dir>/sources` (the fallback: the model downloaded once per pod and attempt, and
  the pod resolves a branch itself: pin a commit, or use a shared volume).
With `spec.sourceCache` the claim is also mounted at SOURCE_CACHE_DIR on every pod that
downloads (writable in the download step only, read-only in the trainer and rollout
containers): the copies are kept there once by content (Hub commit, S3 ETags) for every job
and attempt, and `<output dir>/sources/...` are links into it, so even rollout pods on an
emptyDir read the one cached copy. A job cannot change a cached copy by writing through its
links: its own containers see the cache read-only."""

from __future__ import annotations

import copy
from typing import Any

from rlhf_contract import pod as contract
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.sources import ENV_STORAGE_SECRET, SOURCE_CACHE_DIR, SOURCES_DIR, plan

from .meta import ROLE_ROLLOUT, ROLE_TRAINER
from .pods import OUTPUT_VOLUME, SOURCE_CACHE_VOLUME, PodSettings, mount_of, container_security_context, env_list, output_dir

SOURCES_VOLUME = "sources"
FETCH_CONTAINER = "fetch"


def secret_env(job: RLHFJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, envFrom) that give a container `spec.storageSecret` (empty without one)."""
    secret = job.spec.storage_secret
    if not secret:
        return [], []
    return [{"name": ENV_STORAGE_SECRET, "value": secret}], [{"secretRef": {"name": secret}}]


def _rollout_sources(job: RLHFJob, settings: PodSettings, spec: dict[str, Any]) -> list[str]:
    """Give a rollout pod's server container the job's sources directory (see the module's
    docstring); the names of the volumes the download step mounts writable."""
    out, main = output_dir(job), spec["containers"][0]
    if mount_of(f"{out}/{SOURCES_DIR}", settings.volume_mounts) is not None:
        return []  # the user's volume (spec.pod.volumeMounts) holds it
    if settings.output_claim and settings.output_shared:  # ReadWriteMany: the trainer's copy
        spec["volumes"].append({"name": OUTPUT_VOLUME, "persistentVolumeClaim": {"claimName": settings.output_claim}})
        main["volumeMounts"].append({"name": OUTPUT_VOLUME, "mountPath": out, "readOnly": True})
        return [OUTPUT_VOLUME]
    spec["volumes"].append({"name": SOURCES_VOLUME, "emptyDir": {}})
    main["volumeMounts"].append({"name": SOURCES_VOLUME, "mountPath": f"{out}/{SOURCES_DIR}"})
    return []


def with_storage(job: RLHFJob, settings: PodSettings, spec: dict[str, Any], *, trainer: bool) -> dict[str, Any]:
    """The pod spec with the download step (and a rollout pod's sources, the cache) added in place."""
    out = output_dir(job)
    restore = job.spec.output.uri if trainer else None
    fetches = plan(job, out, model_only=not trainer)
    cache = settings.source_cache_claim if fetches else None
    proc = contract.fetch_process(fetches, restore_uri=restore, output_dir=out,
                                  cache_dir=SOURCE_CACHE_DIR if cache else None)
    if proc is None:
        return spec
    main = spec["containers"][0]
    writable = _rollout_sources(job, settings, spec) if not trainer and fetches else []
    if cache:
        spec["volumes"].append({"name": SOURCE_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache}})
        main["volumeMounts"].append({"name": SOURCE_CACHE_VOLUME, "mountPath": SOURCE_CACHE_DIR, "readOnly": True})
        writable.append(SOURCE_CACHE_VOLUME)
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
        # the server's mounts, writable where the download step writes (the sources, the cache)
        "volumeMounts": [{k: v for k, v in m.items() if k != "readOnly" or m["name"] not in writable}
                         for m in copy.deepcopy(main["volumeMounts"])],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    env_from = env_from + list(job.spec.pod.env_from)
    if env_from:
        init["envFrom"] = env_from
    spec["initContainers"] = [init]
    return spec
