"""The RLHFJob API (`rlhf.dev/v1alpha1`): the one source of truth.

The CRD schema (`rlhfctl crd`), the admission rules (CEL), the defaults, and the config
that the trainer and rollout servers read all come from these pydantic models. YAML uses
camelCase (`samplesPerPrompt`); Python uses the same words in snake_case
(`samples_per_prompt`).

The parts live in common.py, task.py and training.py; this module holds the job, its
spec and status, and re-exports every part. Cross-field rules live in `RULES` (rules.py)
so that the same rule is checked here, in `rlhfctl validate`, and by the API server at
admission.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .common import MAX_NAME_LENGTH, Method, SpecModel, PodScheduling, PodSecurity, PodTemplateSpec, RolePodSpec
from .task import ModelSpec, DataSpec, SandboxServiceSpec, RewardSpec, EnvironmentSpec, AlgorithmSpec, DistillationSpec
from .training import RolloutSpec, TrainerSpec, ScheduleSpec, OutputSpec, RunPolicy, EvaluationSpec, PreferenceSpec, TrackingSpec, SourceCacheSpec
from .common import API_GROUP, API_VERSION, KIND, PLURAL, SHORT_NAME, KubeObject, GPU_RESOURCE, Quantity, Resources, VolumeMount  # noqa: F401  (re-exported)
from .task import TeacherSpec, CodeSandboxSpec, LoraSpec, RewardModelSpec, RewardComponentSpec, Estimator, ESTIMATORS, LossAgg, RolloutCorrectionSpec  # noqa: F401  (re-exported)
from .tools import AgentSpec, ToolFunctionSpec, ToolsSpec  # noqa: F401  (re-exported)
from .training import ColocatedSpec, DeepSpeedSpec, HubOutputSpec, ParallelismSpec, EvalDatasetSpec, WandbSpec, MlflowSpec, SecretKeyRef  # noqa: F401  (re-exported)

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "AlgorithmSpec",
    "CodeSandboxSpec",
    "Condition",
    "DataSpec",
    "ESTIMATORS",
    "EnvironmentSpec",
    "Estimator",
    "EvalDatasetSpec",
    "EvaluationSpec",
    "GPU_RESOURCE",
    "KIND",
    "KUEUE_QUEUE_LABEL",
    "KubeObject",
    "LoraSpec",
    "LossAgg",
    "MAX_NAME_LENGTH",
    "Method",
    "ModelSpec",
    "ObjectMeta",
    "OutputSpec",
    "PLURAL",
    "ParallelismSpec",
    "DeepSpeedSpec",
    "DistillationSpec",
    "PodScheduling",
    "PodSecurity",
    "PodTemplateSpec",
    "RolePodSpec",
    "PreferenceSpec",
    "Progress",
    "Quantity",
    "RLHFJob",
    "RLHFJobSpec",
    "RLHFJobStatus",
    "Resources",
    "RewardComponentSpec",
    "RewardModelSpec",
    "RewardSpec",
    "RolloutCorrectionSpec",
    "RolloutSpec",
    "RunPolicy",
    "SHORT_NAME",
    "SandboxServiceSpec",
    "ScheduleSpec",
    "SourceCacheSpec",
    "SpecModel",
    "TeacherSpec",
    "TrackingSpec",
    "TrainerSpec",
    "VolumeMount",
    "resolve_backend",
]


class RLHFJobSpec(SpecModel):
    """What to train and how."""

    method: Method = Method.RL
    """`rl`: rollouts scored by `reward` (the default); `distill`: rollouts whose tokens a
    teacher scores (`distillation`); offline, from `data` alone with no rollout servers:
    `sft` (supervised fine-tuning), `rm` (a reward model, Bradley-Terry), `dpo` (direct
    preference optimization against the frozen starting model)."""
    model: ModelSpec
    """The policy model."""
    data: DataSpec
    """The training data: prompts (`rl`) or examples (`sft`, `rm`, `dpo`)."""
    reward: RewardSpec = RewardSpec()
    """How responses are scored."""
    environment: EnvironmentSpec | None = None
    """Multi-turn environment; null means single-turn generation scored by `reward`."""
    sandbox_service: SandboxServiceSpec = SandboxServiceSpec()
    """`reward.type: code` on a cluster: the sandbox service pods the operator creates."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """The RL algorithm."""
    distillation: DistillationSpec | None = None
    """`method: distill`: the teacher and the weight of the task reward."""
    rollout: RolloutSpec = RolloutSpec()
    """The rollout servers."""
    trainer: TrainerSpec = TrainerSpec()
    """The trainer."""
    schedule: ScheduleSpec = ScheduleSpec()
    """Steps, batch size and checkpoints."""
    output: OutputSpec = OutputSpec()
    """Outputs."""
    run_policy: RunPolicy = RunPolicy()
    """Restarts and lifetime."""
    backend: Literal["PyTorchJob", "JobSet", "TrainJob"] | None = None
    """How the operator runs the pods on a cluster. `PyTorchJob`: the trainer as a Kubeflow
    PyTorchJob and the rollout servers as a StatefulSet, restarted together by the operator.
    `JobSet`: one JobSet (jobset.x-k8s.io/v1alpha2) holding both as replicated jobs; its
    failure policy is the restart domain (`runPolicy.maxRestarts` restarts) and Kueue admits
    it as one workload. Unset: `JobSet` for a job with the label `kueue.x-k8s.io/queue-name`
    (Kueue admits it whole; its PyTorchJob integration is deprecated, off by default, and would
    leave the rollout StatefulSet a workload of its own), `PyTorchJob` otherwise. `TrainJob`:
    the trainer as a Kubeflow Trainer v2.3 TrainJob referencing the chart's
    ClusterTrainingRuntime `rlhf-torch`, the rollout servers as with `PyTorchJob`, restarted
    together by the operator (a TrainJob cannot set the trainer pods' priority class,
    topology spread, scheduler, init containers or envFrom: such a job is refused). With a
    queue label only `JobSet`, or `TrainJob` when the trainer's pods are all the job has
    (sft, rm, dpo, or colocated rollout), are admitted whole by Kueue: others are refused.
    The cluster must have the backend's CRD (`rlhfctl env` lists them). Ignored in local mode."""
    pod: PodTemplateSpec = Field(default_factory=PodTemplateSpec)
    """Scheduling and volumes of every pod of the job (ignored in local mode)."""
    suspend: bool = False
    """Scale everything to zero, keeping checkpoints; set back to false to resume."""
    preference: PreferenceSpec = PreferenceSpec()
    """`method: dpo` / `rm`: the preference loss."""
    evaluation: EvaluationSpec | None = None
    """Held-out data scored before the first step, every `everySteps` and after the last:
    prompt sets (`method: rl`) or a held-out fraction of `data.path` (`sft`, `rm`, `dpo`)."""
    tracking: TrackingSpec = TrackingSpec()
    """Experiment trackers (TensorBoard by default, Weights & Biases, MLflow) and sample tables."""
    storage_secret: str | None = Field(default=None, min_length=1, max_length=253)
    """A Secret (in the job's namespace) with the credentials of `hf://` and `s3://` models,
    data and outputs, by key, each optional: HF_TOKEN, HF_ENDPOINT (a Hub-compatible
    server), AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL
    or AWS_ENDPOINT_URL_S3 (an S3-compatible server), AWS_REGION (none: the bucket's own).
    Without keys, S3 uses the pods' cloud identity (IRSA, EKS Pod Identity, the instance
    profile: spec.pod.serviceAccountAnnotations). Given to the download step and the trainer
    only (never to rollout servers or the code sandbox). Locally: this environment's."""

    source_cache: SourceCacheSpec | None = None
    """A cache of the `hf://` / `s3://` downloads shared by jobs (a PersistentVolumeClaim);
    none: each job keeps its copies in its own output directory."""

    @property
    def offline(self) -> bool:
        """SFT, RM and DPO train from the dataset alone: no rollout servers."""
        return Method(self.method).offline  # Method(): a model_copy(update=...) may hold the string

    @property
    def trainer_pods_only(self) -> bool:
        """The trainer's pods are the job's only workload: the offline methods (no servers)
        and `rollout.placement: colocated` (the servers run inside the trainer's pods)."""
        return self.offline or self.rollout.placement == "colocated"

    @property
    def trainer_world_size(self) -> int:
        return self.trainer.num_nodes * self.trainer.nproc_per_node

    @property
    def data_parallel_size(self) -> int:
        p = self.trainer.parallelism
        return max(1, self.trainer_world_size // (p.tensor_parallel * p.context_parallel))

    @property
    def samples_per_step(self) -> int:
        return self.schedule.prompts_per_step * self.rollout.samples_per_prompt

    @model_validator(mode="after")
    def _resolve_and_check(self) -> "RLHFJobSpec":
        from .presets import apply_preset
        from .rules import check_spec

        from .rules import RuleViolations
        from .rules_rollout import weight_sync_network_conflicts

        apply_preset(self)
        check_spec(self)
        conflicts = weight_sync_network_conflicts(self)
        if conflicts:
            raise RuleViolations(conflicts)
        return self


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def resolve_backend(backend: str | None, labels: dict[str, str]) -> str:
    """`spec.backend`, or when unset the default for this job (see `RLHFJobSpec.backend`)."""
    return backend or ("JobSet" if labels.get(KUEUE_QUEUE_LABEL) else "PyTorchJob")


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata that the job reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
    )
    namespace: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Condition(SpecModel):
    """A condition as the Kubernetes API conventions define it (metav1.Condition)."""

    type: str = Field(max_length=316)
    """What the condition is about: Suspended, Running, Restarting, Succeeded or Failed."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field(default="", max_length=1024)
    """CamelCase reason of the last transition."""
    message: str = Field(default="", max_length=32768)
    """Human-readable detail of the last transition."""
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The job's metadata.generation this condition was set from."""


class Progress(SpecModel):
    """Training progress reported by the trainer."""

    step: int = Field(default=0, ge=0)
    """Last completed RL step."""
    total_steps: int = Field(default=0, ge=0)
    """Steps the job will run."""
    reward_mean: float | None = None
    """Mean reward of the last step."""
    policy_version: int = Field(default=0, ge=0)
    """Weight version the rollout servers hold."""
    last_checkpoint: str | None = None
    """Newest complete checkpoint."""
    updated_time: str | None = None
    """When the trainer last reported (RFC 3339, UTC)."""
    sources: dict[str, str] | None = None
    """The revision each `hf://` / `s3://` source is pinned to for this job (address: Hub
    commit, or the S3 objects' ETags), fixed by the job's first download."""


class RLHFJobStatus(SpecModel):
    """Observed state, written by the operator (and `progress` by the trainer)."""

    phase: Literal[
        "Pending", "Initializing", "Running", "Restarting", "Suspended", "Succeeded", "Failed"
    ] = "Pending"
    """Where the job is in its life: Pending, Initializing, Running, Restarting, Suspended,
    Succeeded or Failed."""
    conditions: list[Condition] = Field(default=[], json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    """The job's conditions, one per type."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The metadata.generation of the spec this status was computed from."""
    restarts: int = Field(default=0, ge=0)
    """Whole-job restarts so far (the attempt number); those not caused by disruptions count
    against `spec.runPolicy.maxRestarts`."""
    disruptions: int = Field(default=0, ge=0)
    """Of `restarts`, those caused by disruptions (preemption, eviction by a node drain, a
    lost node, SIGTERM): they do not count against `spec.runPolicy.maxRestarts`."""
    message: str = ""
    """Why the job is in its phase (the message of its last transition)."""
    start_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """When the operator first created the job's pods' owners (RFC 3339)."""
    completion_time: str | None = Field(default=None, json_schema_extra={"format": "date-time"})
    """When the job reached Succeeded or Failed (RFC 3339)."""
    progress: Progress = Progress()


class RLHFJob(BaseModel):
    """An RL post-training job."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["rlhf.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLHFJob"]
    metadata: ObjectMeta
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None

    @model_validator(mode="after")
    def _resolve_backend(self) -> "RLHFJob":
        self.spec.backend = resolve_backend(self.spec.backend, self.metadata.labels)
        return self

    def to_config(self) -> dict[str, Any]:
        """The resolved job as JSON-ready data (camelCase), as mounted into every pod."""
        return self.model_dump(mode="json", by_alias=True, exclude={"status"})
