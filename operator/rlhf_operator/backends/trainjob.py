"""`spec.backend: TrainJob`: the trainer as a Kubeflow Trainer v2 TrainJob
(trainer.kubeflow.org/v1alpha1, kubeflow/trainer v2.3) that references the
ClusterTrainingRuntime `rlhf-torch` the chart ships (`build_runtime`); the rollout servers
stay our StatefulSet and headless Service, as with the PyTorchJob backend.

The runtime holds what is the same for every job (the trainer pod's security contexts,
`/dev/shm` and the scratch volume, ports, `restartPolicy: Never`, `backoffLimit: 0`, a
JobSet failure policy of 0 restarts); the TrainJob holds the job's own settings:
`trainer.{image, command, env, numNodes, numProcPerNode, resourcesPerNode}` and one
`runtimePatches` entry (manager `rlhf.dev/operator`; Kueue writes its own entry beside it)
for the `node` job: the JobSet's, Job's and pods' labels (the job's, so the pods are the
job's from birth), the pods' annotations, ServiceAccount, nodeSelector, tolerations,
affinity, a pod securityContext or grace period other than the runtime's, volumes and the
`node` container's volume mounts. Trainer merges the patch into the runtime's JobSet
template (a strategic merge patch: lists by name, maps merged). Trainer v2's torch plugin
sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK and PET_MASTER_ADDR/PORT
(`<trainjob>-node-0-0.<trainjob>:29500`), which `rlhf_trainer.launch` reads as it does
under the training-operator.

Restarts stay ours: one failed pod fails its Job (backoffLimit 0), the JobSet (maxRestarts 0)
and so the TrainJob (condition Failed); the operator then restarts the WHOLE job as with the
PyTorchJob backend (TrainJob and StatefulSet deleted, every pod gone, attempt + 1, resume
from the newest checkpoint), reading exit codes from the pods. The TrainJob never restarts
anything itself, so `runPolicy.maxRestarts` is the only budget.

What a v2.3 TrainJob cannot say is refused by `trainjob_problems` with the field to change
(priority class, topology spread, scheduler, runtime class, resource claims, init containers
(the `hf://` / `s3://` download step: a patch may only change a container the runtime has),
envFrom (`storageSecret`), one volume mounted twice): such a job needs backend JobSet or
PyTorchJob. Trainer v2.0's `podSpecOverrides` and v2.1's renamed field are not written:
the test cluster and the chart's runtime target v2.3.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BACKENDS

from ..builders.meta import (
    COMPLETION_INDEX_LABEL, JOBSET_NAME_LABEL, JOBSET_RJOB_LABEL, LABEL_ATTEMPT, LABEL_JOB, LABEL_JOB_UID,
    LABEL_MANAGED_BY, LABEL_ROLE, MANAGER, ROLE_TRAINER, job_labels, metadata, pod_labels, trainer_name,
)
from ..builders.pods import PodSettings, PodSettingsError, pod_spec, template_metadata
from ..builders.storage import with_storage
from ..builders.workloads import rollout_endpoints, trainer_container, weight_sync_addr
from .base import ROLLOUT_LWS, ROLLOUT_STATEFULSET, Observed, workload_kind
from .jobset import JOBSET_API_VERSION, NEEDS as JOBSET_NEEDS
from .pytorchjob import WholeJobRestarts

NEEDS = BACKENDS["TrainJob"]
TRAINER_API_VERSION = NEEDS.api_version
JOBSET_KIND = JOBSET_NEEDS.backend  # a TrainJob runs as a JobSet
RUNTIME_NAME = "rlhf-torch"
"""The ClusterTrainingRuntime of the chart (charts/rlhf-operator/templates/trainingruntime.yaml)."""
NODE = "node"
"""Trainer v2's name of the trainer's replicated job and container (constants.Node)."""
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
TORCH_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
"""Set by Trainer v2's torch plugin; its webhook refuses them in `trainer.env`."""

# Keys of the trainer pod the runtime fixes (they must equal the runtime's), and where the
# TrainJob carries the rest.
_RUNTIME_POD = ("restartPolicy", "securityContext", "enableServiceLinks", "terminationGracePeriodSeconds",
                "automountServiceAccountToken")
_PATCH_POD = ("serviceAccountName", "nodeSelector", "tolerations", "affinity")
_PATCH_IF_CHANGED = ("securityContext", "terminationGracePeriodSeconds")
"""Runtime keys a runtime patch may change (PodSpecPatch); the others must equal the runtime's."""
PATCH_MANAGER = "rlhf.dev/operator"
"""Our `runtimePatches` entry's manager (a domain-prefixed path, as Trainer's webhook requires)."""
_RUNTIME_CONTAINER = ("name", "ports", "securityContext", "terminationMessagePolicy")
_TRAINER_CONTAINER = {"image": "image", "command": "command", "resources": "resourcesPerNode"}
_BLAME = {  # a pod key the TrainJob cannot set -> the spec field that put it there
    "topologySpreadConstraints": "pod.topologySpreadConstraints",
    "schedulerName": "pod.schedulerName", "priorityClassName": "pod.priorityClassName",
    "runtimeClassName": "pod.runtimeClassName", "resourceClaims": "pod.resourceClaims",
    "imagePullSecrets": "pod.imagePullSecrets",
    "initContainers": "model.path / data.path / output.uri (hf:// and s3:// need the download step)",
    "envFrom": "storageSecret / pod.envFrom",
    "volumeMounts": "pod.volumeMounts (one volume mounted twice: a TrainJob lists mounts by volume name)",
}


class TrainJobError(PodSettingsError):
    """The job asks for something a Trainer v2.3 TrainJob cannot express; names the field
    (a PodSettingsError: the operator fails the job at once, InvalidSpec)."""


def _pod(job: RLHFJob, settings: PodSettings, attempt: int = 0) -> dict[str, Any]:
    """The trainer pod template exactly as the other backends build it, container `node`."""
    container = trainer_container(job, settings, rollout_endpoints=rollout_endpoints(job),
                                  weight_sync_addr=weight_sync_addr(job), name=NODE)
    spec = with_storage(job, settings, pod_spec(job, settings, [container], role=ROLE_TRAINER, restart_policy="Never",
                                                service_account=trainer_name(job.metadata.name)), trainer=True)
    spec.pop("imagePullSecrets", None)  # on the trainer's ServiceAccount instead (backends.build_support)
    return {"metadata": template_metadata(pod_labels(job, ROLE_TRAINER, attempt), settings.role(ROLE_TRAINER)),
            "spec": spec}


def _runtime_pod() -> dict[str, Any]:
    """The runtime's pod template: the parts of a default job's trainer pod that every job shares."""
    return copy.deepcopy(_RUNTIME_POD_CACHE[0] if _RUNTIME_POD_CACHE else _RUNTIME_POD_CACHE.setdefault(0, _build_runtime_pod()))


_RUNTIME_POD_CACHE: dict[int, dict[str, Any]] = {}


def _build_runtime_pod() -> dict[str, Any]:
    from rlhf_contract.api.load import validate_job

    job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
                     "metadata": {"name": "runtime", "uid": "runtime"},
                     "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
                              "pod": {"volumes": [{"name": "output", "emptyDir": {}}],
                                      "volumeMounts": [{"name": "output", "mountPath": "/output"}]}}})
    pod = _pod(job, PodSettings.from_job(job))
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    shared = ("dshm", "scratch")
    return {
        "metadata": {"labels": {LABEL_ROLE: ROLE_TRAINER, LABEL_MANAGED_BY: MANAGER}},
        "spec": {
            **{k: spec[k] for k in _RUNTIME_POD},
            "volumes": [v for v in spec["volumes"] if v["name"] in shared],
            "containers": [{
                **{k: container[k] for k in _RUNTIME_CONTAINER},
                "image": "REPLACED-BY-THE-TRAINJOB",
                "env": [e for e in container["env"] if e["name"] == "HOME"],
                "volumeMounts": [m for m in container["volumeMounts"] if m["name"] in shared],
            }],
        },
    }


def build_runtime(image: str, name: str = RUNTIME_NAME) -> dict[str, Any]:
    """The ClusterTrainingRuntime the chart ships (the chart's template must render to this)."""
    pod = _runtime_pod()
    pod["spec"]["containers"][0]["image"] = image
    job_spec = {"backoffLimit": 0, "template": pod}  # a failed pod fails the Job; the operator restarts
    return {
        "apiVersion": TRAINER_API_VERSION,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": name, "labels": {LABEL_MANAGED_BY: MANAGER}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},  # v2.3: processes per node on the TrainJob only
            # no failurePolicy: the first failed Job fails the JobSet (JobSet never restarts it; the
            # whole job, rollout servers too, restarts as one unit). An explicit maxRestarts 0
            # would make the runtime un-updatable: Trainer's client drops the zero, and JobSet's
            # CEL rule holds failurePolicy immutable.
            "template": {"spec": {
                "replicatedJobs": [{"name": NODE, "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}}, "spec": job_spec}}],
            }},
        },
    }


def trainjob_problems(pod: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What in the trainer pod neither the runtime's pod template nor a TrainJob field can carry."""
    spec, fixed = pod["spec"], runtime["spec"]
    container, fixed_c = spec["containers"][0], fixed["containers"][0]
    keys = [k for k in spec if k not in (*_RUNTIME_POD, *_PATCH_POD, "volumes", "containers") or
            (k in _RUNTIME_POD and k not in _PATCH_IF_CHANGED and spec[k] != fixed[k])]
    keys += [k for k in container if k not in (*_RUNTIME_CONTAINER, *_TRAINER_CONTAINER, "env", "volumeMounts")
             or (k in _RUNTIME_CONTAINER and container[k] != fixed_c[k])]
    names = [m["name"] for m in container["volumeMounts"]]
    if len(names) != len(set(names)):
        keys.append("volumeMounts")
    return [f"spec.{_BLAME.get(k, k)}: a TrainJob (Kubeflow Trainer v2.3) cannot set the trainer pods' {k} "
            f"(the runtime {RUNTIME_NAME} fixes it and no runtime patch carries it); unset it, or use "
            "spec.backend JobSet" for k in dict.fromkeys(keys)]


def check_trainjob(job: RLHFJob, settings: PodSettings, attempt: int = 0) -> dict[str, Any]:
    """The trainer pod, or TrainJobError naming every field a v2.3 TrainJob cannot carry
    (backends.job_settings calls this for backend TrainJob, so the operator fails the job at once)."""
    pod = _pod(job, settings, attempt)
    problems = trainjob_problems(pod, _runtime_pod())
    if problems:
        raise TrainJobError("; ".join(problems))
    return pod


def _not_in(items: list[dict[str, Any]], shared: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names = {i["name"] for i in shared}
    return [copy.deepcopy(i) for i in items if i["name"] not in names]


def _go_form(env: dict[str, Any]) -> dict[str, Any]:
    """An env entry as Go's corev1.EnvVar writes it (an empty value omitted: the same empty
    variable). `spec.trainer` is immutable, and Kueue unsuspends a TrainJob with an update
    of the whole object through Go types: a `value: ""` it would drop fails that update."""
    return {"name": env["name"]} if env.get("value") == "" and "valueFrom" not in env else env


def runtime_patch(pod: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    """Our `runtimePatches` entry: what of the trainer pod `pod` the runtime does not fix, and
    `labels` on the JobSet and its `node` Job."""
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    fixed = _runtime_pod()["spec"]
    pod_spec_patch: dict[str, Any] = {k: copy.deepcopy(spec[k]) for k in _PATCH_POD if spec.get(k)}
    pod_spec_patch.update({k: copy.deepcopy(spec[k]) for k in _PATCH_IF_CHANGED if k in spec and spec[k] != fixed[k]})
    pod_spec_patch["volumes"] = _not_in(spec["volumes"], fixed["volumes"])
    pod_spec_patch["containers"] = [{"name": NODE, "volumeMounts": _not_in(
        container["volumeMounts"], fixed["containers"][0]["volumeMounts"])}]
    node = {"name": NODE, "template": {"metadata": {"labels": dict(labels)}, "spec": {"template": {
        "metadata": copy.deepcopy(pod["metadata"]), "spec": pod_spec_patch}}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {
        "metadata": {"labels": dict(labels)}, "spec": {"replicatedJobs": [node]}}}}


def build_trainjob(job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
    """The TrainJob of attempt `attempt`; raises TrainJobError naming what it cannot carry."""
    pod = check_trainjob(job, settings, attempt)
    container = pod["spec"]["containers"][0]
    t = job.spec.trainer
    trainer: dict[str, Any] = {field: copy.deepcopy(container[key]) for key, field in _TRAINER_CONTAINER.items()}
    trainer.update(numNodes=t.num_nodes, numProcPerNode=t.nproc_per_node,
                   env=[_go_form(e) for e in container["env"] if e["name"] not in TORCH_ENV])
    labels = {**job_labels(job), LABEL_ATTEMPT: str(attempt)}
    return {
        "apiVersion": TRAINER_API_VERSION,
        "kind": NEEDS.backend,
        "metadata": metadata(job, trainer_name(job.metadata.name), labels),
        "spec": {
            "runtimeRef": {"name": RUNTIME_NAME, "apiGroup": NEEDS.group, "kind": "ClusterTrainingRuntime"},
            "trainer": trainer,
            "runtimePatches": [runtime_patch(pod, labels)],
            # only when suspended: otherwise Kueue (admission) owns the field
            **({"suspend": True} if job.spec.suspend else {}),
        },
    }


JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"


def unadopted_selector(job_name: str) -> str:
    """The label selector of the TrainJob's pods that do not carry the job's labels yet."""
    return f"{JOBSET_NAME_LABEL}={trainer_name(job_name)},!{LABEL_JOB}"


def adoption_labels(trainjob: dict[str, Any] | None, jobset: dict[str, Any] | None,
                    pod: dict[str, Any]) -> dict[str, str] | None:
    """The labels a pod of our TrainJob needs to be seen as the job's (`rlhf.dev/job`,
    `job-uid`, `attempt`): a v2.3 TrainJob's pods carry them from the runtime patch; a pod
    made by an older Trainer (v2.0 could not label pods) gets them patched on; or None when
    the pod is not provably of this TrainJob's JobSet: it must carry the JobSet's uid, the
    JobSet must be owned by the TrainJob, and the TrainJob by a job."""
    if trainjob is None or jobset is None:
        return None
    labels = pod["metadata"].get("labels") or {}
    if (labels.get(JOBSET_UID_LABEL) != jobset["metadata"].get("uid")
            or _controller(jobset) != trainjob["metadata"].get("uid") or not _controller(trainjob)):
        return None
    mine = trainjob["metadata"].get("labels") or {}
    return {LABEL_JOB: mine[LABEL_JOB], LABEL_JOB_UID: _controller(trainjob), LABEL_ATTEMPT: mine[LABEL_ATTEMPT]}


def _controller(obj: dict[str, Any]) -> str | None:
    return next((r["uid"] for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def adopt_pods(kube: Any, namespace: str, name: str, trainjob: dict[str, Any]) -> list[dict[str, Any]]:
    """Label the TrainJob's pods that lack the job's labels (v2.3 puts them on through the
    runtime patch; an older Trainer's pods need this), so that the pod watch, the
    NetworkPolicy and `rlhfctl logs` find them; the pods patched. `kube`: a kube.Kube."""
    found = kube.list_pods(namespace, unadopted_selector(name))
    if not found:
        return []
    jobset = kube.get({"apiVersion": JOBSET_API_VERSION, "kind": JOBSET_KIND,
                       "metadata": {"namespace": namespace, "name": trainer_name(name)}})
    return [kube.patch_pod_labels(namespace, pod, labels) for pod in found
            if (labels := adoption_labels(trainjob, jobset, pod)) is not None]


class TrainJobBackend(WholeJobRestarts):
    """The trainer as a TrainJob beside our rollout StatefulSet; restarts are the operator's
    (as PyTorchJob's)."""

    needs = NEEDS
    workload = workload_kind(NEEDS, "trainjob", trainer_name)
    kinds = (ROLLOUT_STATEFULSET, ROLLOUT_LWS, workload)
    done_condition = "Complete"

    def check(self, job: RLHFJob, settings: PodSettings) -> None:
        check_trainjob(job, settings)

    def pull_secrets(self, job: RLHFJob) -> tuple[Any, ...]:  # its pods take them from the ServiceAccount
        return job.spec.pod.image_pull_secrets

    def trainer_rank0(self, job: RLHFJob) -> dict[str, str]:  # pod 0 of the `node` Job of its JobSet (named as it)
        return {JOBSET_NAME_LABEL: trainer_name(job.metadata.name), JOBSET_RJOB_LABEL: NODE,
                COMPLETION_INDEX_LABEL: "0"}

    def build_trainer(self, job: RLHFJob, attempt: int, settings: PodSettings) -> dict[str, Any]:
        return build_trainjob(job, attempt, settings)

    def adopt(self, kube: Any, observed: Observed, namespace: str, name: str) -> Observed:
        if observed.trainjob is None:
            return observed
        adopted = adopt_pods(kube, namespace, name, observed.trainjob)
        return dataclasses.replace(observed, pods=observed.pods + adopted) if adopted else observed


BACKEND = TrainJobBackend()
