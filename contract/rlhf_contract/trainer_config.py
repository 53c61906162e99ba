"""The trainer's own config: the part of a job that the trainer processes read.

The operator writes it into the job's ConfigMap (`trainer.json`) and local mode into the
output directory; the trainer reads it from `RLHF_TRAINER_CONFIG`. It carries no image,
restart policy, node count or Kubernetes metadata beyond the job's name and namespace
(for the progress it reports), so a change to those never reaches a trainer image, and
a unit test builds a trainer from a few fields instead of a whole `RLHFJob`.

The algorithm arrives resolved (presets applied): every field the trainer reads is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .api.common import SpecModel
from .api.models import (AlgorithmSpec, ColocatedSpec, DataSpec, DeepSpeedSpec, DistillationSpec, EnvironmentSpec, EvaluationSpec, HubOutputSpec, LoraSpec, Method, ModelSpec, ParallelismSpec, PreferenceSpec, RewardSpec,
                         RLHFJob, RLHFJobSpec, RolloutSpec, ScheduleSpec, TrackingSpec, TrainerSpec)
from .api.serving import VllmSpec
from .api.rules import violations
from .api.task import RolloutCorrectionSpec
from .api.tools import AgentSpec, ToolsSpec


class _Config(SpecModel):
    """Checks numbers as the API models do (no booleans, NaN, infinity or beyond int64)."""

    model_config = ConfigDict(validate_default=False)


class SamplingConfig(_Config):
    """How the rollout servers sample and where they run (from `spec.rollout`, under the
    spec's own names, so `_as_spec` gives the rules what the job said)."""

    samples_per_prompt: int = Field(default=8, ge=1)
    """Responses per prompt (the group size)."""
    max_tokens: int = Field(default=1024, ge=1)
    """Maximum response length in tokens."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the trainer's log-probs use the same one."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k; -1 disables it."""
    max_staleness: int = Field(default=0, ge=0)
    """Policy versions a sample may lag behind the trainer (0: synchronous)."""
    in_flight_updates: bool = False
    """`rollout.inFlightUpdates`: weight updates pause the servers with mode keep (requests in
    flight continue on the new weights); staleness is bounded and logged per token; with the
    plain sampler, partial rollouts (trainer orchestrator/partial.py)."""
    placement: Literal["separate", "colocated"] = "separate"
    """`rollout.placement`: `colocated` servers share the trainer's devices and sleep while it
    trains (read by the trainer in rl/placement.py only)."""
    colocated: ColocatedSpec = Field(default_factory=ColocatedSpec)
    """`rollout.colocated`: the turns' settings, read with placement colocated."""
    engine: Literal["vllm", "cpu"] = "vllm"
    """`rollout.engine`: what serves the rollouts (the colocation rules depend on it)."""
    kv_cache_memory_bytes: int | None = None
    """`rollout.vllm.kvCacheMemoryBytes` (per GPU): the colocated memory plan's KV cache."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """`rollout.tensorParallelSize`: GPUs per rollout server (the colocated plan's weights per GPU)."""
    quantization: str | None = None
    """`rollout.vllm.quantization` (FP8 rollouts): the colocated plan's server weights."""


    @property
    def weight_update_pause_mode(self) -> str:
        """vLLM's pause mode of a weight update: "keep" (requests in flight go on with the new
        weights) with `in_flight_updates`, else "wait" (they finish on the old ones first)."""
        return "keep" if self.in_flight_updates else "wait"

class OptimConfig(_Config):
    """The optimizer and the micro-batch budget (from `spec.trainer`)."""

    learning_rate: float = Field(default=1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup."""
    min_learning_rate_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the decay, as a fraction of learning_rate."""
    max_tokens_per_micro_batch: int = Field(default=16384, ge=1)
    """Token budget of one packed forward/backward pass."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Tensor and context parallel degrees, activation checkpointing."""
    gpu_memory_gib: float | None = Field(default=None, gt=0, alias="gpuMemoryGiB")
    """Memory of one GPU for the memory plan (`trainer.gpuMemoryGiB`); null: detected."""
    engine: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """Training engine (`trainer.engine`)."""
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    """ZeRO settings (`trainer.deepspeed`)."""


class OutputConfig(_Config):
    """What the trainer writes (from `spec.output`)."""

    dir: str = ""
    """Output directory; RLHF_OUTPUT_DIR wins when set."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """Complete checkpoints kept."""
    save_rollouts: bool = False
    """Write every step's samples to `rollouts/step-N.jsonl`."""
    uri: str | None = None
    """`s3://` location receiving each checkpoint and `final/` (`output.uri`)."""
    hub: HubOutputSpec | None = None
    """Hub repository receiving `final/` (`output.hub`)."""


@dataclass(frozen=True)
class ReferenceModel:
    """The frozen model a job's loss compares against (`TrainerConfig.reference_model`)."""

    path: str
    """The model directory it is read from."""
    copy: bool
    """Loaded as a second model; False: the policy's own base with its LoRA adapters off."""
    teacher: bool
    """A distillation teacher (`distillation.teacher`), not the starting model."""


STALE_CORRECTION = RolloutCorrectionSpec(mode="tis")
"""`algorithm.rolloutCorrection` of a job with `rollout.maxStaleness` >= 1 that sets none (nor
the deprecated tisCap): stale samples are corrected toward the trainer's policy by truncated
importance sampling, cap `DEFAULT_TIS_UPPER` (resolved here, so the mounted config shows it)."""

# Fields of AlgorithmSpec that may stay null once a preset is applied.
_OPTIONAL_ALGORITHM_FIELDS = {"dual_clip", "critic_learning_rate", "tis_cap", "rollout_correction"}


class TrainerConfig(_Config):
    """Everything a trainer process reads, and nothing else."""

    job_name: str = Field(min_length=1)
    """The RLHFJob's name (metrics labels, progress reports)."""
    method: Method = Method.RL
    """`rl` and `distill` (rollouts), or offline from the data alone: `sft`, `rm`, `dpo`."""
    preference: PreferenceSpec = Field(default_factory=PreferenceSpec)
    """`dpo` / `rm`: the preference loss."""
    evaluation: EvaluationSpec | None = None
    """Held-out data and when to score it (every method)."""
    namespace: str | None = None
    """The RLHFJob's namespace on a cluster; null in local mode."""
    model_path: str = Field(min_length=1)
    """Policy model directory."""
    lora: LoraSpec | None = None
    """Adapters on the frozen policy (`model.lora`); null: every weight trains."""
    data: DataSpec
    """The prompts."""
    reward: RewardSpec = Field(default_factory=RewardSpec)
    """How responses are scored."""
    environment: EnvironmentSpec | None = None
    """Multi-turn environment, if any."""
    tools: ToolsSpec | None = None
    """Tools the policy may call in its rollouts (`rollout.tools`), if any."""
    agent: AgentSpec | None = None
    """The agent program that runs each episode (`rollout.agent`), if any."""
    algorithm: AlgorithmSpec
    """The RL algorithm, resolved (no preset field left null)."""
    distillation: DistillationSpec | None = None
    """`method: distill`: the teacher and the task reward's weight."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How the rollout servers sample."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer, clipping, micro-batch budget, parallelism."""
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    """Steps, prompts per step, checkpoint period, seed."""
    output: OutputConfig = Field(default_factory=OutputConfig)
    """Outputs."""
    rollout_startup_timeout_seconds: int = Field(default=1800, ge=1)
    """How long to wait for the rollout servers to start (`rollout.startupTimeoutSeconds`)."""
    rollout_request_timeout_seconds: float = Field(default=600.0, gt=0)
    """How long a generation request may go unanswered (`rollout.requestTimeoutSeconds`)."""
    rollout_weight_sync_timeout_seconds: float = Field(default=600.0, gt=0)
    """How long a weight-sync round may take (`rollout.weightSyncTimeoutSeconds`)."""
    rollout_max_server_replacements: int = Field(default=0, ge=0)
    """Rollout servers that may be lost and re-joined per attempt (`rollout.maxServerReplacements`)."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """Experiment trackers (`spec.tracking`)."""
    termination_grace_period_seconds: int = Field(default=60, ge=1)
    """SIGTERM to SIGKILL (`runPolicy.terminationGracePeriodSeconds`): the time left to end the
    step in flight and save a checkpoint."""

    @model_validator(mode="after")
    def _algorithm_resolved(self) -> "TrainerConfig":
        unset = [name for name, value in self.algorithm if value is None and name not in _OPTIONAL_ALGORITHM_FIELDS]
        if unset:
            raise ValueError(f"algorithm fields {unset} are unset: the trainer config carries a resolved algorithm "
                             "(build it with TrainerConfig.from_job, which applies the preset)")
        return self

    @classmethod
    def from_job(cls, job: RLHFJob) -> "TrainerConfig":
        s = job.spec
        r, t, o = s.rollout, s.trainer, s.output
        # the deprecated tisCap becomes its rolloutCorrection: the trainer reads one field
        correction = s.algorithm.correction() or (STALE_CORRECTION if r.max_staleness else None)
        algorithm = s.algorithm.model_copy(update={"rollout_correction": correction, "tis_cap": None})
        return cls(
            job_name=job.metadata.name, namespace=job.metadata.namespace, model_path=s.model.path, lora=s.model.lora,
            method=s.method, preference=s.preference, evaluation=s.evaluation,
            data=s.data, reward=s.reward, environment=s.environment, tools=r.tools, agent=r.agent, algorithm=algorithm,
            distillation=s.distillation, sampling=SamplingConfig(samples_per_prompt=r.samples_per_prompt, max_tokens=r.max_tokens,
                                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    max_staleness=r.max_staleness,
                                    in_flight_updates=r.in_flight_updates,
                                    placement=r.placement, colocated=r.colocated, engine=r.engine,
                                    kv_cache_memory_bytes=r.vllm.kv_cache_memory_bytes,
                                    tensor_parallel_size=r.tensor_parallel_size,
                                    quantization=r.vllm.quantization if r.engine == "vllm" else None),
            optim=OptimConfig(learning_rate=t.learning_rate, weight_decay=t.weight_decay,
                              max_grad_norm=t.max_grad_norm, lr_scheduler=t.lr_scheduler, warmup_steps=t.warmup_steps,
                              min_learning_rate_ratio=t.min_learning_rate_ratio,
                              max_tokens_per_micro_batch=t.max_tokens_per_micro_batch, parallelism=t.parallelism,
                              gpu_memory_gib=t.gpu_memory_gib, engine=t.engine, deepspeed=t.deepspeed),
            schedule=s.schedule,
            output=OutputConfig(dir=o.dir, keep_checkpoints=o.keep_checkpoints, save_rollouts=o.save_rollouts,
                                uri=o.uri, hub=o.hub),
            rollout_startup_timeout_seconds=r.startup_timeout_seconds,
            rollout_request_timeout_seconds=r.request_timeout_seconds,
            rollout_weight_sync_timeout_seconds=r.weight_sync_timeout_seconds,
            rollout_max_server_replacements=r.max_server_replacements,
            tracking=s.tracking, termination_grace_period_seconds=s.run_policy.termination_grace_period_seconds,
        )

    def reference_model(self) -> ReferenceModel | None:
        """The frozen model the method's loss compares against (the method's `reference`
        fact, MethodFacts), or None: the one place that decides it, for the loaders, both
        engines and the memory plan."""
        kind = Method(self.method).facts.reference
        if kind == "teacher":
            return ReferenceModel(self.distillation.teacher.path, copy=True, teacher=True) if self.distillation else None
        if kind == "always" or (kind == "kl" and self.algorithm.kl_coef):
            return ReferenceModel(self.model_path, copy=self.lora is None, teacher=False)
        return None

    def rule_problems(self, world_size: int) -> list[str]:
        """The contract's cross-field RULES that this config breaks on a trainer world of
        `world_size` processes (the real one, which a hand-built config may not match), as
        `spec.<field>: <message>` lines."""
        return [f"spec.{path}: {message}" for path, message in violations(self._as_spec(world_size))]

    def _as_spec(self, world_size: int) -> RLHFJobSpec:
        """The job spec this config was cut from, on one node of `world_size` processes; not
        validated, so the rules can be checked on it one by one."""
        s, o = self.sampling, self.optim
        return RLHFJobSpec.model_construct(
            method=Method(self.method), model=ModelSpec(path=self.model_path, lora=self.lora), data=self.data,
            reward=self.reward, environment=self.environment, algorithm=self.algorithm, schedule=self.schedule,
            distillation=self.distillation,
            preference=self.preference, evaluation=self.evaluation,
            rollout=RolloutSpec.model_construct(samples_per_prompt=s.samples_per_prompt, max_tokens=s.max_tokens,
                                                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                max_staleness=s.max_staleness, tools=self.tools,
                                                agent=self.agent, placement=s.placement, colocated=s.colocated,
                                                engine=s.engine, tensor_parallel_size=s.tensor_parallel_size,
                                                vllm=VllmSpec.model_construct(
                                                    kv_cache_memory_bytes=s.kv_cache_memory_bytes)),
            trainer=TrainerSpec.model_construct(num_nodes=1, nproc_per_node=world_size, parallelism=o.parallelism,
                                                max_tokens_per_micro_batch=o.max_tokens_per_micro_batch,
                                                engine=o.engine, deepspeed=o.deepspeed))

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "TrainerConfig":
        return cls.model_validate_json(text)
