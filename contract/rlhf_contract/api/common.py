"""Shared pieces of the RLHFJob API: the API's names, the method enum, the base model every
spec part derives from (camelCase in YAML, snake_case in Python, docstrings as descriptions,
unknown fields refused, numbers checked as the API server checks them), Kubernetes quantities
and objects, and the pod template fields.

Numbers: every `int` or `float` field of a `SpecModel` refuses a boolean, NaN and infinity,
and an integer outside int64 (what the API server stores; `INT_MAX`); `ApiJsonSchema` puts the same
int64 bounds into the CRD. Bounds that make a value work (a batch of at least 1) stay on
each field. This module does not check cross-field rules (rules.py does).
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator,
                      model_validator)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from .methods import METHOD_FACTS, Method, MethodFacts  # noqa: F401  (the API's method enum)
from .uris import url_credentials
from .pod_security import MAX_POD_VOLUMES, ANNOTATIONS_CEL, VOLUME_SCHEMA, check_annotations, check_group, check_volume


API_GROUP = "rlhf.dev"
API_VERSION = "v1alpha1"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SHORT_NAME = "rlj"
MAX_NAME_LENGTH = 40  # `<name>-rollout-<hash>` and `<name>-trainer-worker-N` stay within 63

INT_MIN, INT_MAX = -(2**63), 2**63 - 1024
"""The integers a spec field may hold: int64, as the API server stores them, with the top
end rounded down to a float64 (a CRD's `maximum` is one: 2**63 - 1 would round up to 2**63,
which the API server reads back as int64's minimum and then refuses every value)."""
INT32_MAX = 2**31 - 1
"""Kubernetes' own counts are int32 (replicas, a probe's failureThreshold, JobSet's
maxRestarts): a spec field that becomes one is bounded by this."""
MAX_SECONDS = INT32_MAX
"""A duration in seconds (timeouts, deadlines): int32 seconds, about 68 years, as Kubernetes'
own durations; beyond it Python's timers overflow."""
SEED_MAX = 2**32 - 1
"""Seeds go to NumPy and vLLM (`--seed`), which take 0 <= seed < 2**32."""


def number_kind(annotation: Any) -> type | None:
    """`int` or `float` when a field holds a number (`int`, `float | None`, ...), else None."""
    if annotation in (int, float):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = {number_kind(a) for a in typing.get_args(annotation)} - {None}
        return kinds.pop() if len(kinds) == 1 else None
    return None


class SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,  # NaN and infinity: no JSON number, and no setting works with them
    )

    @field_validator("*", mode="before")
    @classmethod
    def _number_not_bool_or_text(cls, value: Any, info: ValidationInfo) -> Any:
        kind = number_kind(cls.model_fields[info.field_name].annotation)
        if kind is not None and isinstance(value, bool):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        if kind is int and isinstance(value, str):  # YAML reads 1e-6 as text, so floats may be
            raise ValueError(f"must be an integer, not the string {value!r:.40}")
        if kind is int and isinstance(value, float) and not math.isnan(value):
            return _int64(value)  # 1.0e+30: said as such, not as pydantic's parse failure
        return value

    @field_validator("*")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        return _int64(value) if type(value) is int else value


def _int64(value: int | float) -> int | float:
    if not INT_MIN <= value <= INT_MAX:
        raise ValueError(f"must be between {INT_MIN} and {INT_MAX} (the API server stores int64)")
    return value


class ApiJsonSchema(GenerateJsonSchema):
    """pydantic's JSON schema with every integer an int64, bounded as `SpecModel` bounds it."""

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        out = super().int_schema(schema)
        out["format"] = "int64"
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = INT_MIN
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = INT_MAX
        return out


# A Kubernetes object kept as written (a Volume, a Toleration, an Affinity): the API server
# checks it when the operator creates the pods; the CRD keeps its unknown fields.
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
CRD_SCHEMA = "x-rlhf-crd-schema"
"""In a field's JSON schema: the schema the CRD uses instead (crd.py); the docs and pydantic
see a Kubernetes object kept as written."""
PodVolume = Annotated[dict[str, Any], AfterValidator(check_volume), WithJsonSchema(
    {"type": "object", "x-kubernetes-preserve-unknown-fields": True, CRD_SCHEMA: VOLUME_SCHEMA})]
"""A Kubernetes Volume of an allowed type (api/pod_security.py)."""
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
GPU_RESOURCE = "nvidia.com/gpu"


def _quantity(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a Kubernetes quantity such as 4, 500m, 64Gi")
    if isinstance(value, (int, float)):
        value = str(value)
    if isinstance(value, str) and not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (examples: 4, 500m, 64Gi, 1.5)")
    return value


Quantity = Annotated[str, BeforeValidator(_quantity), WithJsonSchema({"x-kubernetes-int-or-string": True})]


class Resources(SpecModel):
    """CPU, memory and other non-GPU resources of a container (GPUs come from
    `trainer.nprocPerNode` and `rollout.tensorParallelSize`)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": f"!has(self.requests) || !('{GPU_RESOURCE}' in self.requests)",
         "message": f"{GPU_RESOURCE} is set from trainer.nprocPerNode / rollout.tensorParallelSize; remove it here"},
        {"rule": f"!has(self.limits) || !('{GPU_RESOURCE}' in self.limits)",
         "message": f"{GPU_RESOURCE} is set from trainer.nprocPerNode / rollout.tensorParallelSize; remove it here"},
    ]})
    requests: dict[str, Quantity] = {}
    """Requested amounts, e.g. {cpu: "16", memory: 200Gi}; the scheduler reserves them."""
    limits: dict[str, Quantity] = {}
    """Limits, e.g. {memory: 200Gi}; a container above its memory limit is killed (OOMKilled)."""

    @field_validator("requests", "limits")
    @classmethod
    def _no_gpus(cls, value: dict[str, str]) -> dict[str, str]:
        if GPU_RESOURCE in value:
            raise ValueError(f"{GPU_RESOURCE} is set from trainer.nprocPerNode / rollout.tensorParallelSize; "
                             "remove it here")
        return value


class VolumeMount(SpecModel):
    """Where a volume of `pod.volumes` appears in every container."""

    name: str = Field(min_length=1)
    """Name of a volume in `pod.volumes`."""
    mount_path: str = Field(min_length=1, pattern=r"^/")
    """Absolute path in the container."""
    sub_path: str | None = None
    """Mount only this sub-directory of the volume."""
    read_only: bool = False
    """Mount read-only (the output directory cannot be on such a mount)."""


RESERVED_ENV_PREFIXES = ("RLHF_", "PET_")
"""Environment names the operator sets in the job's containers."""


RUN_AS_USER = 1000
"""The pods' uid when `securityContext.runAsUser` is unset (any non-root uid works)."""
OPERATOR_LABEL_PREFIXES = ("rlhf.dev/", "jobset.sigs.k8s.io/", "training.kubeflow.org/")
_RESOURCE_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$"


def _int_item(value: Any) -> Any:
    """A list's integer item, refused as `SpecModel` refuses a number field's bad values."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not {str(value).lower()}")
    if isinstance(value, str):
        raise ValueError(f"must be an integer, not the string {value!r:.40}")
    return value


GroupId = Annotated[int, Field(ge=1, le=INT32_MAX), BeforeValidator(_int_item), BeforeValidator(check_group)]


class PodSecurity(SpecModel):
    """The pods' identity on the node (always non-root: the `restricted` Pod Security level;
    never root's group 0)."""

    run_as_user: int | None = Field(default=None, ge=1, le=INT32_MAX)
    """uid of every container (1000 when unset), e.g. the uid an NFS export maps."""
    run_as_group: int | None = Field(default=None, ge=1, le=INT32_MAX)
    """Primary gid of every container (runAsUser when unset)."""
    fs_group: int | None = Field(default=None, ge=1, le=INT32_MAX)
    """Group that owns the pod's volumes (runAsGroup when unset)."""
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = None
    """When the kubelet hands volumes to fsGroup: `OnRootMismatch` (when unset) only when the
    volume's root is not already the group's, so a large volume is not walked at every start;
    `Always` at every start."""
    supplemental_groups: list[GroupId] | None = None
    """More groups of every container (e.g. the group of a shared dataset)."""

    @field_validator("run_as_group", "fs_group", mode="before")
    @classmethod
    def _no_root_group(cls, value: Any) -> Any:
        return check_group(value)


class PodScheduling(SpecModel):
    """Where a pod runs and what it carries. In `spec.pod` for every pod of the job; in
    `trainer.pod` / `rollout.pod` for that role's pods, where each field that is set replaces
    `spec.pod`'s (labels and annotations are merged key by key, the role's winning)."""

    labels: dict[str, str] | None = Field(default=None, json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in OPERATOR_LABEL_PREFIXES) + ")",
        "message": f"labels under {', '.join(OPERATOR_LABEL_PREFIXES)} are set by the operator; use another key"}]})
    """Labels of the pods (not `rlhf.dev/` ones: those are the operator's)."""
    annotations: dict[str, str] | None = Field(default=None, json_schema_extra=ANNOTATIONS_CEL)
    """Annotations of the pods, e.g. a Multus network for RDMA
    {k8s.v1.cni.cncf.io/networks: rdma-net} (not security profiles: the operator sets those)."""
    node_selector: dict[str, str] | None = None
    """Node labels a pod's node must have, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}."""
    tolerations: list[KubeObject] | None = None
    """Kubernetes tolerations, e.g. [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]."""
    affinity: KubeObject | None = None
    """A Kubernetes affinity (node / pod affinity and anti-affinity)."""
    topology_spread_constraints: list[KubeObject] | None = None
    """Kubernetes topologySpreadConstraints of the pods."""
    scheduler_name: str | None = Field(default=None, min_length=1)
    """The scheduler that places the pods (e.g. volcano, kai-scheduler); the default scheduler when unset."""
    priority_class_name: str | None = None
    """PriorityClass of the pods (preemption order)."""
    runtime_class_name: str | None = Field(default=None, min_length=1)
    """RuntimeClass of the pods (e.g. nvidia)."""
    security_context: PodSecurity | None = None
    """uid, gid, fsGroup (and when it is applied) and supplemental groups of the pods."""
    service_account_annotations: dict[str, str] | None = None
    """Annotations of the pods' ServiceAccount (cloud IAM, e.g.
    {iam.gke.io/gcp-service-account: ...} or {eks.amazonaws.com/role-arn: ...}): the trainer's
    `<job>-trainer`; rollout servers get a ServiceAccount `<job>-rollout` of their own when set."""
    resource_claims: list[KubeObject] | None = None
    """Dynamic resource allocation: the pod's resourceClaims ({name, resourceClaimName} or
    {name, resourceClaimTemplateName}); the main container claims each of them."""
    accelerator_resource: str | None = Field(default=None, pattern=_RESOURCE_NAME)
    """The extended resource that counts GPUs (`nvidia.com/gpu` when unset; e.g. amd.com/gpu)."""

    @field_validator("labels")
    @classmethod
    def _own_labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        taken = sorted(k for k in value or {} if k.startswith(OPERATOR_LABEL_PREFIXES))
        if taken:
            raise ValueError(f"{', '.join(taken)}: labels under {', '.join(OPERATOR_LABEL_PREFIXES)} are set by "
                             "the operator; use another key")
        return value

    @field_validator("annotations")
    @classmethod
    def _no_profiles(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_annotations(value)

    def over(self, base: "PodScheduling") -> "PodScheduling":
        """These settings over `base` (spec.pod), with every default filled in."""
        merged = {name: getattr(self, name) if getattr(self, name) is not None else getattr(base, name)
                  for name in PodScheduling.model_fields}
        for name in ("labels", "annotations"):
            merged[name] = {**(getattr(base, name) or {}), **(getattr(self, name) or {})}
        sec = (merged["security_context"] or PodSecurity()).model_copy()
        sec.run_as_user = sec.run_as_user or RUN_AS_USER
        sec.run_as_group = sec.run_as_group if sec.run_as_group is not None else sec.run_as_user
        sec.fs_group = sec.fs_group if sec.fs_group is not None else sec.run_as_group
        sec.fs_group_change_policy = sec.fs_group_change_policy or "OnRootMismatch"
        merged.update(security_context=sec, accelerator_resource=merged["accelerator_resource"] or GPU_RESOURCE,
                      service_account_annotations=merged["service_account_annotations"] or {})
        for name in ("node_selector", "tolerations", "topology_spread_constraints", "resource_claims"):
            if merged[name] is None:
                merged[name] = {} if name == "node_selector" else []
        return PodScheduling.model_construct(**merged)


class RolePodSpec(PodScheduling):
    """One role's pods (`trainer.pod`, `rollout.pod`): each field set here replaces
    `spec.pod`'s for these pods only (labels and annotations are merged)."""


class PodTemplateSpec(PodScheduling):
    """What every pod of the job (trainer and rollout servers) gets on a real cluster:
    where it may run and what it mounts (`trainer.pod` / `rollout.pod` override the
    scheduling fields per role)."""
    image_pull_secrets: list[str] = []
    """Names of Secrets (in the job's namespace) used to pull the images."""
    volumes: list[PodVolume] = Field(default=[], max_length=MAX_POD_VOLUMES)
    """Kubernetes volumes, e.g. [{name: work, persistentVolumeClaim: {claimName: rlhf-work}}];
    the model, the data and the output directory must be on one of them. Types:
    persistentVolumeClaim, configMap, emptyDir, ephemeral, csi, nfs, downwardAPI, projected
    (configMap and downwardAPI sources); hostPath only where the operator is installed with
    security.allowHostPath; never secret (use the job's Secret fields)."""
    volume_mounts: list[VolumeMount] = []
    """Mounts of `volumes` into every container."""
    env: list[KubeObject] = []
    """Environment variables of the trainer and rollout containers and of their download step
    (Kubernetes EnvVar: {name, value} or {name, valueFrom: {secretKeyRef: ...}}), e.g. NCCL
    settings, a tracker's credentials, HTTPS_PROXY, HF_XET_HIGH_PERFORMANCE or AWS_REGION.
    Not given to the code sandbox."""
    env_from: list[KubeObject] = []
    """Kubernetes EnvFromSource of the trainer and rollout containers and of their download
    step, e.g. [{secretRef: {name: mlflow-credentials}}]."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, v in enumerate(value):
            name = v.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"env[{i}] needs a name")
            if name.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"env[{i}].name: {name} is set by the operator (names starting with "
                                 f"{', '.join(RESERVED_ENV_PREFIXES)} are reserved); use another name")
            found = url_credentials(v["value"]) if isinstance(v.get("value"), str) else None
            if found:  # e.g. HF_ENDPOINT or AWS_ENDPOINT_URL with user:password@
                raise ValueError(f"env[{i}].value: carries a credential ({found}); give {name} through "
                                 "valueFrom.secretKeyRef (or storageSecret for the storage variables)")
        return value

    @field_validator("volumes")
    @classmethod
    def _named(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, v in enumerate(value):
            if not isinstance(v.get("name"), str) or not v["name"]:
                raise ValueError(f"volumes[{i}] needs a name (it is how volumeMounts refer to it)")
        return value

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> "PodTemplateSpec":
        names = [v["name"] for v in self.volumes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"volumes: duplicate name(s) {', '.join(dup)}")
        for i, m in enumerate(self.volume_mounts):
            if m.name not in names:
                raise ValueError(f"volumeMounts[{i}].name: {m.name!r} is not a volume in pod.volumes "
                                 f"(have: {', '.join(names) or 'none'})")
        return self


class SecretKeyRef(SpecModel):
    """A key of a Secret in the job's namespace."""

    name: str = Field(min_length=1)
    """The Secret's name."""
    key: str = Field(min_length=1)
    """The key holding the value."""
