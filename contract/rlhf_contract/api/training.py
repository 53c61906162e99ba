"""How a job runs: rollout servers, trainer and parallelism, schedule, outputs, restarts, evaluation, preferences."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..images import INFERENCE_IMAGE, TRAINER_IMAGE
from .common import INT32_MAX, MAX_SECONDS, SEED_MAX, SecretKeyRef, SpecModel, Resources, RolePodSpec
from .serving import ColocatedSpec, VllmSpec  # noqa: F401  (re-exported)
from .task import DatasetSource
from .tools import AgentSpec, ToolsSpec
from .uris import CONFIG_NAME, ENV_SECRET, EndpointUrl, check_no_parent, parse_remote


class RolloutSpec(SpecModel):
    """The rollout (generation) servers."""

    engine: Literal["vllm", "cpu"] = "vllm"
    """`vllm` on GPUs; `cpu` is the built-in Hugging Face engine (local mode always uses it)."""
    image: str = INFERENCE_IMAGE
    """Container image of the rollout servers: vLLM 0.33.0 (`vllm/vllm-openai:v0.33.0` plus
    this project's inference package); any image must run a vLLM with the weight-transfer
    API (0.33 or newer) and the trainer's NCCL release (the trainer checks both at start)."""
    replicas: int = Field(default=1, ge=1, le=INT32_MAX)
    """Number of rollout servers."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per rollout server (vLLM tensor parallel size), over all its nodes."""
    nodes_per_server: int = Field(default=1, ge=1, le=INT32_MAX)
    """Pods (nodes) one rollout server spans, tensorParallelSize / nodesPerServer GPUs each; above 1 a LeaderWorkerSet."""
    samples_per_prompt: int = Field(default=8, ge=1, le=INT32_MAX)
    """Responses sampled for each prompt (the group size)."""
    max_tokens: int = Field(default=1024, ge=1, le=INT32_MAX)
    """Maximum response length in tokens."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (above 0: the trainer divides the logits by it, as the sampler did)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling probability mass. RL needs 1: the trainer's log-probs are of the whole
    temperature-scaled distribution, which a truncated sampler does not draw from."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 disables it (RL needs it disabled, as topP)."""
    resources: Resources = Field(default_factory=Resources)
    """CPU and memory of each rollout server container (GPUs: `tensorParallelSize`)."""
    pod: RolePodSpec = Field(default_factory=RolePodSpec)
    """Scheduling of the rollout server pods over `spec.pod` (e.g. another GPU type's node pool)."""
    startup_timeout_seconds: int = Field(default=1800, ge=60, le=MAX_SECONDS)
    """How long a rollout server may take to start (model load, CUDA graph capture): its
    startup probe allows this long, and the trainer waits this long for it."""
    request_timeout_seconds: float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    """A generation request (one prompt's samples) unanswered this long fails the step: a
    server that hangs (stopped, deadlocked) ends the attempt and the job restarts."""
    weight_sync_timeout_seconds: float = Field(default=600.0, gt=0, le=MAX_SECONDS)
    """A weight-sync round not over in this long fails the step (exit code 75, retried); a trainer stuck in it is ended a minute later."""
    weight_sync_network: Literal["auto", "socket", "ib"] = "auto"
    """NCCL's network for the weight sync, set in the trainer's and the servers' pods: `auto` lets NCCL choose, `socket` TCP
    (NCCL_NET=Socket, NCCL_IB_DISABLE=1), `ib` InfiniBand verbs (NCCL_NET=IB; the trainer refuses to start without a device)."""
    max_server_replacements: int = Field(default=3, ge=0, le=INT32_MAX)
    """Rollout servers that may die and be replaced per attempt without a job restart (re-joined with the current weights); 0: any loss restarts the job."""
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    """`vllm serve` settings (memory, batching, prefix caching, extra flags); engine vllm only."""
    max_staleness: int = Field(default=0, ge=0)
    """Policy versions a sample may lag behind the trainer. 0: synchronous (generate, then
    train). k >= 1: the next k steps' rollouts are generated while the trainer trains, stale
    samples corrected by `algorithm.rolloutCorrection` (truncated IS, cap 2.0, when unset)."""
    in_flight_updates: bool = False
    """With `maxStaleness` >= 1: a weight update keeps the requests in flight (vLLM's `/pause?mode=keep`; their later tokens
    come from the new weights, staleness bounded per token), and a step trains the first prompts' groups to finish."""
    placement: Literal["separate", "colocated"] = "separate"
    """`separate`: the rollout servers have devices of their own. `colocated`: they share the
    trainer's devices and take turns with it: generate, sleep while the trainer trains, wake
    for the weight update (synchronous only). On a cluster the servers run inside the one
    trainer pod, `replicas` x `tensorParallelSize` = its GPUs (`python -m
    rlhf_trainer.supervise` starts and supervises them), and no rollout workload is made."""
    colocated: ColocatedSpec = Field(default_factory=ColocatedSpec)
    """Sleep level and trainer offload of `placement: colocated`."""
    tools: ToolsSpec | None = None
    """Tools (OpenAI function schemas, Python functions) the model calls in multi-turn episodes (docs/methods.md)."""
    agent: AgentSpec | None = None
    """An agent program of one's own, run per episode against an OpenAI-compatible endpoint."""

    @property
    def gpus_per_server(self) -> int:
        """Accelerators one rollout server uses: none for the CPU engine."""
        return 0 if self.engine == "cpu" else self.tensor_parallel_size


class ParallelismSpec(SpecModel):
    """Model and sequence parallelism; data-parallel sharding (FSDP2) takes the rest of the
    world: dataParallel = world size / (tensorParallel x contextParallel)."""

    tensor_parallel: int = Field(default=1, ge=1, le=INT32_MAX)
    """Tensor-parallel degree (within a node); must divide the attention and KV heads."""
    context_parallel: int = Field(default=1, ge=1, le=INT32_MAX)
    """Context-parallel degree: each rank holds a contiguous slice of the packed sequence."""
    activation_checkpointing: bool | None = None
    """Recompute each decoder layer's activations in the backward pass. Unset: on GPUs,
    on exactly when the memory plan without it does not fit (`rlhfctl plan` shows the
    decision); on CPU (local mode), off."""


class DeepSpeedSpec(SpecModel):
    """DeepSpeed ZeRO settings (`trainer.engine: deepspeed`)."""

    zero_stage: Literal[2, 3] = 3
    """2: optimizer state and gradients partitioned over the data-parallel ranks; 3: the
    parameters too (the frozen reference and reward models run as ZeRO-3 inference)."""
    offload_optimizer: bool = False
    """Keep the optimizer state on the host and step it there (DeepSpeed's CPU Adam):
    less GPU memory, slower steps."""
    offload_params: bool = False
    """Keep the partitioned parameters on the host between uses (ZeRO-3 only)."""
    reduce_bucket_size: int = Field(default=500_000_000, ge=1)
    """Elements per gradient reduction bucket."""
    param_persistence_threshold: int = Field(default=100_000, ge=0)
    """ZeRO-3: parameters with fewer elements stay whole on every rank (0: partition all)."""


class TrainerSpec(SpecModel):
    """The trainer processes (torchrun)."""

    image: str = TRAINER_IMAGE
    """Container image of the trainer."""
    num_nodes: int = Field(default=1, ge=1, le=INT32_MAX)
    """Trainer pods (torchrun nodes)."""
    nproc_per_node: int = Field(default=1, ge=1, le=INT32_MAX)
    """Trainer processes per pod (GPUs per pod)."""
    device: Literal["gpu", "cpu"] = "gpu"
    """`gpu`: each trainer pod requests `nprocPerNode` GPUs. `cpu`: the trainer processes run
    on CPU (gloo) and the pods request no accelerator: a tiny model, CI, a cluster or a
    machine without GPUs."""
    learning_rate: float = Field(default=1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradient clipping by global norm."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warmup: constant, linear decay or cosine decay to
    `minLearningRateRatio` x learningRate at the last optimizer step."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear warmup from 0 to learningRate."""
    min_learning_rate_ratio: float = Field(default=0.0, ge=0, le=1)
    """Floor of the linear / cosine decay, as a fraction of learningRate."""
    max_tokens_per_micro_batch: int = Field(default=16384, ge=1, le=INT32_MAX)
    """Token budget of one packed forward/backward pass per GPU (sequences are packed
    without padding and balanced across data-parallel ranks); must hold the longest
    possible sequence, data.maxPromptLength + rollout.maxTokens. The default fits a 7B
    model in bf16 with activation checkpointing under FSDP over 8 x 80 GB GPUs (the
    log-prob head never holds more than 1024 tokens of fp32 logits)."""
    parallelism: "ParallelismSpec" = Field(default_factory=lambda: ParallelismSpec())
    """How the model and the sequences are split over the trainer processes."""
    engine: Literal["fsdp2", "deepspeed"] = "fsdp2"
    """Training engine: PyTorch FSDP2 (with tensor and context parallelism), or DeepSpeed
    ZeRO-2/3 (data parallel only; optimizer and parameter offload, `trainer.deepspeed`)."""
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    """ZeRO stage, offload and bucket settings; read with `engine: deepspeed` only."""
    gpu_memory_gib: float | None = Field(default=None, gt=0, le=4096, alias="gpuMemoryGiB")
    """Memory of one trainer GPU in GiB, for the memory plan that the trainer checks before
    it loads anything (a job that cannot fit fails at once, naming what to change). Unset:
    the trainer pod reads it from `nvidia-smi`; with neither (local CPU mode) no plan is
    checked. `rlhfctl plan` prints the plan."""
    resources: Resources = Field(default_factory=Resources)
    """CPU and memory of each trainer pod's container (GPUs: `nprocPerNode`)."""
    pod: RolePodSpec = Field(default_factory=RolePodSpec)
    """Scheduling of the trainer pods over `spec.pod` (e.g. another GPU type's node pool)."""

    @property
    def gpus_per_pod(self) -> int:
        """Accelerators each trainer pod requests: `nprocPerNode`, none with `device: cpu`."""
        return 0 if self.device == "cpu" else self.nproc_per_node


class ScheduleSpec(SpecModel):
    """How long to train and how often to save."""

    total_steps: int = Field(default=100, ge=1)
    """Number of training steps."""
    prompts_per_step: int = Field(default=32, ge=1, le=INT32_MAX)
    """Prompts sampled per RL step (each gets `rollout.samplesPerPrompt` responses); sft / rm /
    dpo: examples (sequences or pairs) per step."""
    save_every: int = Field(default=50, ge=0)
    """Save a checkpoint every this many steps; 0 saves only the final model."""
    seed: int = Field(default=0, ge=0, le=SEED_MAX)
    """Seed for data order, sampling and the built-in model's weights (0 to 2^32 - 1, as
    NumPy and vLLM's `--seed` take)."""


class HubOutputSpec(SpecModel):
    """Where `final/` goes on the Hugging Face Hub (or a Hub-compatible server, HF_ENDPOINT)."""

    repo: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
    """Model repository `<org>/<name>`, created when missing."""
    every: int = Field(default=0, ge=0)
    """Also push the model every this-many steps: consolidated safetensors, config, tokenizer
    and model card (LoRA: merged, the adapters in `adapter/`) as a commit of the repository
    tagged `step-<N>`, loadable with `from_pretrained(repo, revision="step-<N>")` (0: `final/`
    only, at the end)."""
    private: bool = True
    """Create the repository private."""


class OutputSpec(SpecModel):
    """Where results go."""

    dir: str = ""
    """Output directory; empty means `runs/<job name>` in local mode and `/output` in pods.
    In pods it must be on a writable mounted volume: `claimName`, or a `pod.volumeMounts`
    entry that contains it."""
    claim_name: str | None = None
    """A PersistentVolumeClaim mounted at `dir` in the trainer pods, so checkpoints survive
    restarts (ReadWriteMany when `trainer.numNodes` > 1). When it is ReadWriteMany the
    rollout pods mount it too (read-only) and read the trainer's `hf://` / `s3://` copies.
    Not needed with `uri` on one node: the trainer pods then write into an emptyDir and
    the bucket keeps the checkpoints."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """How many complete checkpoints to keep."""
    save_rollouts: bool = False
    """Write every step's samples (token ids, loss mask, text, reward) to
    `rollouts/step-N.jsonl` for inspection."""
    uri: str | None = Field(default=None, pattern=r"^s3://")
    """`s3://<bucket>/<prefix>`: each complete checkpoint and `final/` are uploaded there
    after they are written locally, in the background while training goes on
    (`<prefix>/checkpoints/step-N/`, `COMPLETE` last; `<prefix>/final/`), and a job whose
    output directory holds no complete checkpoint resumes from the newest one there. On a
    cluster no volume is needed then (an emptyDir holds the output directory). Credentials:
    `storageSecret`."""
    license: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")
    """The trained model's license for its model card (e.g. `apache-2.0`); null: the base
    model's card's license, when its copy has a card that names one."""
    hub: HubOutputSpec | None = None
    """Push `final/` (with its model card) to a Hub model repository at the end."""

    @field_validator("uri")
    @classmethod
    def _s3_uri(cls, value: str | None) -> str | None:
        if value is not None:
            parse_remote(value)
        return value

    @field_validator("dir")
    @classmethod
    def _stays_on_its_volume(cls, value: str) -> str:
        return check_no_parent(value)


_CLAIM_NAME = r"^[a-z0-9]$|^[a-z0-9][-.a-z0-9]*[a-z0-9]$"
"""A PersistentVolumeClaim's name (a DNS subdomain: lowercase letters, digits, '-' and '.')."""


class SourceCacheSpec(SpecModel):
    """A download cache shared by jobs: a PersistentVolumeClaim (ReadWriteMany when the
    jobs' pods run on several nodes) that keeps each `hf://` / `s3://` copy once, by what
    identifies its content (the Hub commit, the S3 objects' ETags)."""

    claim_name: str = Field(min_length=1, max_length=253, json_schema_extra={"pattern": _CLAIM_NAME})
    """The PersistentVolumeClaim (in the job's namespace; a DNS subdomain name such as
    `model-cache`), mounted on every pod that downloads: writable by the download step only,
    read-only in the trainer and rollout containers. A second job (or attempt) with the same
    commit or ETags downloads nothing. Not `output.claimName` (a cache is not one job's).
    Ignored in local mode."""

    @field_validator("claim_name")
    @classmethod
    def _claim_name(cls, value: str) -> str:
        if not re.fullmatch(_CLAIM_NAME, value):
            raise ValueError(f"{value!r} is not a PersistentVolumeClaim name: use lowercase letters, digits, '-' "
                             "and '.', starting and ending with a letter or digit (e.g. model-cache)")
        return value


class WandbSpec(SpecModel):
    """Weights & Biases: rank 0 logs every metrics.jsonl key, the resolved job spec as the
    run's config, and tables of samples."""

    project: str = Field(min_length=1)
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null: the key's default entity."""
    name: str | None = None
    """Run name; null: the job's name."""
    tags: list[str] = []
    """Run tags."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under `<output>/wandb` for `wandb sync` later (no network, no key)."""
    api_key_secret: SecretKeyRef | None = None
    """The Secret key holding the API key (becomes WANDB_API_KEY in the trainer pods; locally
    the environment's WANDB_API_KEY is used)."""
    base_url: EndpointUrl("tracking.wandb.apiKeySecret", pattern=r"^https?://") | None = None
    """A self-hosted W&B server (WANDB_BASE_URL)."""


class MlflowSpec(SpecModel):
    """MLflow: rank 0 logs every metrics.jsonl key, the resolved job spec as parameters and
    an artifact, and tables of samples."""

    tracking_uri: EndpointUrl(f"MLFLOW_TRACKING_TOKEN (or _USERNAME / _PASSWORD) from {ENV_SECRET}", min_length=1)
    """`http(s)://` tracking server, or a store the trainer can write: `file:///...` or
    `sqlite:///...` on the output volume. Credentials (MLFLOW_TRACKING_TOKEN, ...) through
    `pod.env` / `pod.envFrom`."""
    experiment: str | None = None
    """Experiment name; null: the job's name."""
    run_name: str | None = None
    """Run name; null: the job's name."""


class TrackingSpec(SpecModel):
    """Where rank 0 logs the run besides metrics.jsonl and Prometheus. A resumed run logs
    into the same TensorBoard directory, W&B run and MLflow run (no duplicate steps)."""

    tensorboard: bool = True
    """TensorBoard event files under `<output>/tensorboard`."""
    wandb: WandbSpec | None = None
    """Weights & Biases."""
    mlflow: MlflowSpec | None = None
    """MLflow."""
    samples_every: int = Field(default=10, ge=0)
    """`method: rl`: every this many steps (and at the first), a table of sampled prompts,
    completions and rewards goes to each tracker; 0: never."""
    samples_per_table: int = Field(default=8, ge=1, le=1024)
    """Rows of that table (the step's first samples)."""


class RunPolicy(SpecModel):
    """Restarts and lifetime, as for a Kubernetes Job."""

    max_restarts: int = Field(default=3, ge=0, le=INT32_MAX)
    """Whole-job restarts before the job is Failed."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=MAX_SECONDS)
    """Fail the job after this many seconds of running."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=MAX_SECONDS)
    """Delete the job this many seconds after it finished."""
    termination_grace_period_seconds: int = Field(default=60, ge=1, le=MAX_SECONDS)
    """Seconds a pod has between SIGTERM (preemption, node drain, spot notice, suspend, a
    restart) and SIGKILL: every pod's `terminationGracePeriodSeconds`. In this time the
    trainer finishes or abandons the step in flight and writes a complete checkpoint, which
    the job resumes from. Give it more than one checkpoint's save time (AWS spot: 120 s of
    notice, GKE: 30 s)."""


class EvalDatasetSpec(DatasetSource):
    """One held-out prompt set, read with `spec.data`'s keys."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Name in the metrics (`eval/<name>/...`, Prometheus label `dataset`)."""
    path: str = Field(min_length=1)
    """A file or directory, `hf://` or `s3://` address, as `data.path` (or a built-in task: 64 prompts unseen in training)."""
    config: str | None = Field(default=None, min_length=1, max_length=128, pattern=CONFIG_NAME)
    """The config of a Hub dataset repository, as `data.config` (not inherited from it)."""
    split: str = "train"
    """Split of a dataset with several."""
    max_prompts: int | None = Field(default=None, ge=1)
    """Score only the first this-many prompts (null: all)."""


class EvaluationSpec(SpecModel):
    """Held-out data scored during training, for every method, before the first step, every
    `everySteps` steps and after the last (`eval/<name>/<metric>` metrics). RL: prompt sets
    (`datasets`) scored with the job's reward through the rollout servers. sft / rm / dpo:
    the held-out fraction of `data.path` (`heldOutFraction`), metrics `eval/held_out/...`."""

    every_steps: int = Field(default=0, ge=0)
    """Score every this many steps (0: only before the first step and after the last)."""
    datasets: list[EvalDatasetSpec] = Field(default_factory=list)
    """`method: rl`: the held-out prompt sets (names unique)."""
    held_out_fraction: float = Field(default=0.0, ge=0, lt=1)
    """`method: sft` / `rm` / `dpo`: fraction of `data.path`'s examples held out (a built-in
    task holds out 200 examples of a disjoint range, or this fraction x 1000)."""
    samples_per_prompt: int = Field(default=1, ge=1)
    """k sampled responses per prompt at the job's temperature: mean score and pass@k
    (a prompt passes when one of its k responses scores at least 1)."""
    greedy: bool = True
    """Also score one greedy (temperature 0) response per prompt."""

    @model_validator(mode="after")
    def _unique_names(self) -> "EvaluationSpec":
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"evaluation.datasets: names must be unique, got {names}")
        return self


class PreferenceSpec(SpecModel):
    """`method: dpo` (and `rm`'s margin): how preference pairs are turned into a loss."""

    beta: float = Field(default=0.1, gt=0)
    """DPO: scale of the implicit reward beta x (log pi - log pi_ref)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO: `sigmoid` (the DPO paper) or `ipo` (squared distance to 1 / (2 beta))."""
    label_smoothing: float = Field(default=0.0, ge=0, le=0.5)
    """DPO and RM (sigmoid): assumed probability that a pair's label is flipped (conservative DPO)."""


