"""The RLHFJob API (`rlhf.dev/v1alpha1`): the one source of truth.

The CRD schema (`rlhfctl crd`), the admission rules (CEL), the defaults, and the config
that the trainer and rollout servers read all come from these pydantic models. YAML uses
camelCase (`samplesPerPrompt`); Python uses the same words in snake_case
(`samples_per_prompt`).

Cross-field rules live in `RULES` (rules.py) so that the same rule is checked here, in
`rlhfctl validate`, and by the API server at admission.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel

from ..images import INFERENCE_IMAGE, TRAINER_IMAGE

API_GROUP = "rlhf.dev"
API_VERSION = "v1alpha1"
KIND = "RLHFJob"
PLURAL = "rlhfjobs"
SHORT_NAME = "rlj"
MAX_NAME_LENGTH = 40  # `<name>-rollout-<hash>` and `<name>-trainer-worker-N` stay within 63


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=True,
    )


# A Kubernetes object kept as written (a Volume, a Toleration, an Affinity): the API server
# checks it when the operator creates the pods; the CRD keeps its unknown fields.
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
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


class Resources(_Model):
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


class VolumeMount(_Model):
    """Where a volume of `pod.volumes` appears in every container."""

    name: str = Field(min_length=1)
    """Name of a volume in `pod.volumes`."""
    mount_path: str = Field(min_length=1, pattern=r"^/")
    """Absolute path in the container."""
    sub_path: str | None = None
    """Mount only this sub-directory of the volume."""
    read_only: bool = False
    """Mount read-only (the output directory cannot be on such a mount)."""


class PodTemplateSpec(_Model):
    """What every pod of the job (trainer and rollout servers) gets on a real cluster:
    where it may run and what it mounts."""

    node_selector: dict[str, str] = {}
    """Node labels a pod's node must have, e.g. {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}."""
    tolerations: list[KubeObject] = []
    """Kubernetes tolerations, e.g. [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]."""
    affinity: KubeObject | None = None
    """A Kubernetes affinity (node / pod affinity and anti-affinity)."""
    priority_class_name: str | None = None
    """PriorityClass of the pods (preemption order)."""
    image_pull_secrets: list[str] = []
    """Names of Secrets (in the job's namespace) used to pull the images."""
    volumes: list[KubeObject] = []
    """Kubernetes volumes, e.g. [{name: work, persistentVolumeClaim: {claimName: rlhf-work}}];
    the model, the data and the output directory must be on one of them."""
    volume_mounts: list[VolumeMount] = []
    """Mounts of `volumes` into every container."""

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


class ModelSpec(_Model):
    """The policy model to train."""

    path: str = Field(min_length=1)
    """Hugging Face model directory (in Kubernetes: a path on a mounted volume), or a
    built-in model: `builtin://tiny-qwen2`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for the rollout servers (`vllm serve --dtype`)."""


class DataSpec(_Model):
    """Where prompts come from."""

    path: str = Field(min_length=1)
    """A local dataset (in Kubernetes: on a mounted volume): a JSON, JSONL, CSV, Parquet or
    Arrow file, a directory of them, or a `save_to_disk` directory; or a built-in task:
    `builtin://last-digit`, `builtin://sum-mod-10`."""
    split: str = "train"
    """Split to read from a dataset with several."""
    prompt_key: str = "prompt"
    """Column holding the prompt text (or a list of chat turns)."""
    messages_key: str = "messages"
    """Column holding chat turns ({role, content}), rendered with the model's chat template."""
    answer_key: str = "answer"
    """Column holding the reference answer passed to the reward (`gt_answer` is also accepted)."""
    system_prompt: str | None = None
    """System prompt added to every prompt through the chat template."""
    max_prompt_length: int = Field(default=1024, ge=1)
    """Prompts longer than this many tokens are dropped (the count is logged)."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by `schedule.seed`)."""
    response_key: str = "response"
    """`method: sft`: column of the response text (with `promptKey`; or `messagesKey` turns)."""
    chosen_key: str = "chosen"
    """`method: rm` / `dpo`: column of the preferred response (text or an assistant message)."""
    rejected_key: str = "rejected"
    """`method: rm` / `dpo`: column of the dispreferred response."""


class CodeSandboxSpec(_Model):
    """Where model-written programs run (`reward.type: code`) and their per-run limits."""

    url: str | None = Field(default=None, pattern=r"^https?://")
    """A sandbox service to use (this project's `rlhf_trainer.rewards.sandbox_service`);
    null: on a cluster the operator creates `<job>-sandbox`, locally the trainer runs programs
    itself with bubblewrap."""
    memory_mb: int = Field(default=512, ge=32)
    """Address space of each process of a run (MiB)."""
    max_processes: int = Field(default=4, ge=1, le=1024)
    """Processes and threads of one run together."""
    tmpfs_mb: int = Field(default=64, ge=1)
    """The run's only writable space, /tmp (MiB, counted in memory)."""
    max_output_kb: int = Field(default=1024, ge=1)
    """stdout and stderr are each cut here; a run that goes past it fails its case."""


class SandboxServiceSpec(_Model):
    """The pods that run model-written programs for `reward.type: code` on a cluster
    (`<job>-sandbox`), unless `reward.sandbox.url` names another service."""

    replicas: int = Field(default=1, ge=1)
    """Sandbox service pods (cluster only)."""
    cpu: str = Field(default="4", pattern=r"^[0-9]+(\.[0-9]+)?m?$")
    """CPU of each sandbox pod (request = limit); it runs that many programs at once."""
    memory: str = Field(default="12Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
    """Memory of each sandbox pod (request = limit); it runs no more programs at once than
    fit at memoryMb x maxProcesses + tmpfsMb each."""
    seccomp_localhost_profile: str | None = None
    """Run the sandbox pod under this node-local seccomp profile (`Localhost`, allowed at the
    `restricted` level) instead of RuntimeDefault, which forbids the user namespaces that
    per-run isolation needs; the profile must allow unshare/clone with CLONE_NEWUSER."""


class RewardModelSpec(_Model):
    """A learned reward model, scored in the trainer processes (laid out like the reference
    model: FSDP over the trainer's ranks, packed, no gradients)."""

    path: str = Field(min_length=1)
    """Directory of a Hugging Face sequence classifier with one label (what `method: rm`
    exports to `<output>/final`); the score of a sequence is at its last token."""
    weight: float = 1.0
    """The step reward is the verifiable reward (0 for `type: model`) + weight x score."""


class RewardSpec(_Model):
    """How a response is scored. A reward function returns `reward` (used for advantages)
    and `score` (logged); the built-in ones return the same number for both."""

    type: Literal["exact_match", "prefix_match", "math", "code", "python", "http", "model"] = "exact_match"
    """`exact_match` / `prefix_match`: the stripped response equals / starts with the answer;
    `math`: the final boxed or <answer> answer is equivalent to the answer (math-verify);
    `code`: the last fenced Python block passes the row's `test_cases` in a sandbox;
    `python`: `function` from the user file `file`; `http`: POST to `url`; `model`: the
    reward model `model` alone."""
    model: RewardModelSpec | None = None
    """A reward model whose weighted score is added to the reward (required by `type: model`;
    with another type the two are combined)."""
    file: str | None = None
    """`python`: path of the file defining the reward function."""
    function: str = "reward_fn"
    """`python`: name of `fn(response, answer, extra_info) -> float | {reward, score}`."""
    url: str | None = None
    """`http`: endpoint that answers {response, answer, extra_info} with {reward, score}."""
    timeout_seconds: float = Field(default=10.0, gt=0)
    """`code`: wall-clock limit per test case; `math`: per answer; `http`: per request."""
    all_or_nothing: bool = False
    """`code`: 1 only when every test case passes (default: the fraction that pass)."""
    require_sandbox_isolation: bool = True
    """`code`: refuse to run model code without per-run namespaces (bubblewrap: its own root
    filesystem view, /proc and network per run; needs unprivileged user namespaces, not root).
    false lets the operator's sandbox pod run programs with resource limits only, where the pod
    (no token, no data, no egress) is the only barrier, e.g. under the RuntimeDefault seccomp
    profile, which forbids user namespaces."""
    sandbox: CodeSandboxSpec = CodeSandboxSpec()
    """`code`: where and within which limits model-written programs run."""


class EnvironmentSpec(_Model):
    """A multi-turn environment (RL2's contract); when set, rewards come from it."""

    file: str | None = Field(default=None, min_length=1)
    """Python file defining `async def step(state, action, extra_info)` returning
    {next_state, reward, score, done, extra_info}."""
    gem: str | None = Field(default=None, min_length=1)
    """Instead of `file`: a GEM environment id (the `gem-llm` package, e.g.
    `game:GuessTheNumber-v0-easy`); its reset observations are the prompts
    (`data.path: builtin://gem`) and its step feedback the environment's turns."""
    max_turns: int = Field(default=4, ge=1)
    """Model turns per trajectory; `rollout.maxTokens` bounds the whole trajectory."""


Estimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
"""The advantage estimators, in one place (the trainer's `compute_advantages` reads them)."""
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class AlgorithmSpec(_Model):
    """The RL algorithm. `preset` sets the defaults of every field left unset (null);
    see presets.py and the README's preset table."""

    preset: Literal["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
    """A named algorithm whose settings fill every field you leave unset."""
    advantage_estimator: Estimator | None = None
    """How advantages are computed: gae (PPO, needs the critic), grpo, dr_grpo, rloo,
    reinforce_pp, reinforce_pp_baseline."""
    norm_std: bool | None = None
    """grpo: divide by the group's std; gae: whiten advantages over the batch."""
    loss_agg: LossAgg | None = None
    """How per-token losses are reduced: token-mean, seq-mean-token-mean,
    seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO)."""
    clip_low: float | None = Field(default=None, ge=0)
    """PPO ratio clip below 1: ratio >= 1 - clipLow."""
    clip_high: float | None = Field(default=None, ge=0)
    """PPO ratio clip above 1: ratio <= 1 + clipHigh (DAPO's clip-higher: 0.28)."""
    dual_clip: float | None = Field(default=None, gt=1)
    """Dual-clip constant c > 1 for negative advantages; null disables it."""
    kl_coef: float | None = Field(default=None, ge=0)
    """Weight of KL(policy || reference); 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """Per-token KL estimator (Schulman's k1, k2, k3)."""
    kl_mode: Literal["loss", "reward"] | None = None
    """Where the KL goes: a loss term, or a per-token penalty in the reward (before advantages)."""
    gamma: float | None = Field(default=None, ge=0, le=1)
    """Discount for gae and reinforce_pp."""
    lam: float | None = Field(default=None, ge=0, le=1)
    """GAE lambda."""
    critic: bool | None = None
    """Train a value model (a value head on a copy of the policy) for gae."""
    value_clip: float | None = Field(default=None, gt=0)
    """Clip of the value loss around the old values."""
    critic_learning_rate: float | None = Field(default=None, gt=0)
    """Critic AdamW learning rate; null uses trainer.learningRate."""
    dynamic_sampling: bool | None = None
    """DAPO: drop groups whose rewards are all equal and sample more prompts to refill."""
    max_sampling_rounds: int = Field(default=4, ge=1)
    """Dynamic sampling gives up refilling after this many rollout rounds per step."""
    overlong_buffer: int | None = Field(default=None, ge=0)
    """DAPO soft overlong punishment: the last this-many tokens before rollout.maxTokens
    are penalised linearly down to -1; 0 disables it."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Truncated importance sampling against the rollout engine's logprobs, weights capped
    at this value; null disables it (with rollout.maxStaleness >= 1 the trainer config
    resolves null to 2.0)."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of an entropy bonus in the policy loss."""
    num_mini_batches: int = Field(default=1, ge=1)
    """Optimizer steps per RL step; the step's samples are split into this many parts."""


class RolloutSpec(_Model):
    """The rollout (generation) servers."""

    engine: Literal["vllm", "cpu"] = "vllm"
    """`vllm` on GPUs; `cpu` is the built-in Hugging Face engine (local mode always uses it)."""
    image: str = INFERENCE_IMAGE
    """Container image of the rollout servers: vLLM 0.33.0 (`vllm/vllm-openai:v0.33.0` plus
    this project's inference package); any image must run a vLLM with the weight-transfer
    API (0.32 or newer)."""
    replicas: int = Field(default=1, ge=1)
    """Number of rollout servers."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per rollout server (vLLM tensor parallel size)."""
    samples_per_prompt: int = Field(default=8, ge=1)
    """Responses sampled for each prompt (the group size)."""
    max_tokens: int = Field(default=1024, ge=1)
    """Maximum response length in tokens."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling probability mass."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k sampling; -1 disables it."""
    resources: Resources = Field(default_factory=Resources)
    """CPU and memory of each rollout server container (GPUs: `tensorParallelSize`)."""
    startup_timeout_seconds: int = Field(default=1800, ge=60)
    """How long a rollout server may take to start (model load, CUDA graph capture): its
    startup probe allows this long, and the trainer waits this long for it."""
    max_staleness: int = Field(default=0, ge=0)
    """Policy versions a sample may lag behind the trainer. 0: synchronous (generate, then
    train). k >= 1: the rollouts of the next k steps are generated while the trainer trains
    (weights are pushed between requests), stale samples are corrected by truncated
    importance sampling (`algorithm.tisCap`, 2.0 when unset)."""


class ParallelismSpec(_Model):
    """Model and sequence parallelism; data-parallel sharding (FSDP2) takes the rest of the
    world: dataParallel = world size / (tensorParallel x contextParallel)."""

    tensor_parallel: int = Field(default=1, ge=1)
    """Tensor-parallel degree (within a node); must divide the attention and KV heads."""
    context_parallel: int = Field(default=1, ge=1)
    """Context-parallel degree: each rank holds a contiguous slice of the packed sequence."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""


class TrainerSpec(_Model):
    """The trainer processes (torchrun)."""

    image: str = TRAINER_IMAGE
    """Container image of the trainer."""
    num_nodes: int = Field(default=1, ge=1)
    """Trainer pods (torchrun nodes)."""
    nproc_per_node: int = Field(default=1, ge=1)
    """Trainer processes per pod (GPUs per pod)."""
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
    max_tokens_per_micro_batch: int = Field(default=16384, ge=1)
    """Token budget of one packed forward/backward pass per GPU (sequences are packed
    without padding and balanced across data-parallel ranks); must hold the longest
    possible sequence, data.maxPromptLength + rollout.maxTokens. The default fits a 7B
    model in bf16 with activation checkpointing under FSDP over 8 x 80 GB GPUs (the
    log-prob head never holds more than 1024 tokens of fp32 logits)."""
    parallelism: "ParallelismSpec" = Field(default_factory=lambda: ParallelismSpec())
    """How the model and the sequences are split over the trainer processes."""
    resources: Resources = Field(default_factory=Resources)
    """CPU and memory of each trainer pod's container (GPUs: `nprocPerNode`)."""


class ScheduleSpec(_Model):
    """How long to train and how often to save."""

    total_steps: int = Field(default=100, ge=1)
    """Number of RL steps."""
    prompts_per_step: int = Field(default=32, ge=1)
    """Prompts sampled per RL step (each gets `rollout.samplesPerPrompt` responses)."""
    save_every: int = Field(default=50, ge=0)
    """Save a checkpoint every this many steps; 0 saves only the final model."""
    seed: int = 0
    """Seed for data order, sampling and the built-in model's weights."""


class OutputSpec(_Model):
    """Where results go."""

    dir: str = ""
    """Output directory; empty means `runs/<job name>` in local mode and `/output` in pods.
    In pods it must be on a writable mounted volume: `claimName`, or a `pod.volumeMounts`
    entry that contains it."""
    claim_name: str | None = None
    """A PersistentVolumeClaim mounted at `dir` in the trainer pods, so checkpoints survive
    restarts (ReadWriteMany when `trainer.numNodes` > 1)."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """How many complete checkpoints to keep."""
    save_rollouts: bool = False
    """Write every step's samples (token ids, loss mask, text, reward) to
    `rollouts/step-N.jsonl` for inspection."""


class RunPolicy(_Model):
    """Restarts and lifetime, as for a Kubernetes Job."""

    max_restarts: int = Field(default=3, ge=0)
    """Whole-job restarts before the job is Failed."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the job after this many seconds of running."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    """Delete the job this many seconds after it finished."""


class EvalDatasetSpec(_Model):
    """One held-out prompt set, read with `spec.data`'s keys."""

    name: str = Field(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Name in the metrics (`eval/<name>/...`, Prometheus label `dataset`)."""
    path: str = Field(min_length=1)
    """A file or directory as `data.path` (or a built-in task: 64 prompts unseen in training)."""
    split: str = "train"
    """Split of a dataset with several."""
    max_prompts: int | None = Field(default=None, ge=1)
    """Score only the first this-many prompts (null: all)."""


class EvaluationSpec(_Model):
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


class PreferenceSpec(_Model):
    """`method: dpo` (and `rm`'s margin): how preference pairs are turned into a loss."""

    beta: float = Field(default=0.1, gt=0)
    """DPO: scale of the implicit reward beta x (log pi - log pi_ref)."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO: `sigmoid` (the DPO paper) or `ipo` (squared distance to 1 / (2 beta))."""
    label_smoothing: float = Field(default=0.0, ge=0, le=0.5)
    """DPO and RM (sigmoid): assumed probability that a pair's label is flipped (conservative DPO)."""


Method = Literal["rl", "sft", "rm", "dpo"]


class RLHFJobSpec(_Model):
    """What to train and how."""

    method: Method = "rl"
    """`rl`: rollouts scored by `reward` (the default); offline, from `data` alone with no
    rollout servers: `sft` (supervised fine-tuning), `rm` (a reward model, Bradley-Terry),
    `dpo` (direct preference optimization against the frozen starting model)."""
    model: ModelSpec
    """The policy model."""
    data: DataSpec
    """The prompts."""
    reward: RewardSpec = RewardSpec()
    """How responses are scored."""
    environment: EnvironmentSpec | None = None
    """Multi-turn environment; null means single-turn generation scored by `reward`."""
    sandbox_service: SandboxServiceSpec = SandboxServiceSpec()
    """`reward.type: code` on a cluster: the sandbox service pods the operator creates."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """The RL algorithm."""
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
    backend: Literal["PyTorchJob", "JobSet"] = "PyTorchJob"
    """How the operator runs the pods on a cluster. `PyTorchJob`: the trainer as a Kubeflow
    PyTorchJob and the rollout servers as a StatefulSet, restarted together by the operator.
    `JobSet`: one JobSet (jobset.x-k8s.io/v1alpha2) holding both as replicated jobs; its
    failure policy is the restart domain (`runPolicy.maxRestarts` restarts) and Kueue admits
    it as one workload. Ignored in local mode."""
    pod: PodTemplateSpec = Field(default_factory=PodTemplateSpec)
    """Scheduling and volumes of every pod of the job (ignored in local mode)."""
    suspend: bool = False
    """Scale everything to zero, keeping checkpoints; set back to false to resume."""
    preference: PreferenceSpec = PreferenceSpec()
    """`method: dpo` / `rm`: the preference loss."""
    evaluation: EvaluationSpec | None = None
    """`method: rl`: held-out prompt sets scored before training, every `everySteps` and at the end."""

    @property
    def offline(self) -> bool:
        """SFT, RM and DPO train from the dataset alone: no rollout servers."""
        return self.method != "rl"

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

        apply_preset(self)
        check_spec(self)
        return self


class ObjectMeta(BaseModel):
    """The part of Kubernetes metadata that the job reads; the rest is kept as is."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(
        min_length=1, max_length=MAX_NAME_LENGTH, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
    )
    namespace: str | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Condition(_Model):
    """A Kubernetes-style condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class Progress(_Model):
    """Training progress reported by the trainer."""

    step: int = 0
    """Last completed RL step."""
    total_steps: int = 0
    """Steps the job will run."""
    reward_mean: float | None = None
    """Mean reward of the last step."""
    policy_version: int = 0
    """Weight version the rollout servers hold."""
    last_checkpoint: str | None = None
    """Newest complete checkpoint."""
    updated_time: str | None = None
    """When the trainer last reported (RFC 3339, UTC)."""


class RLHFJobStatus(_Model):
    """Observed state, written by the operator (and `progress` by the trainer)."""

    phase: Literal[
        "Pending", "Initializing", "Running", "Restarting", "Suspended", "Succeeded", "Failed"
    ] = "Pending"
    conditions: list[Condition] = []
    observed_generation: int | None = None
    restarts: int = 0
    progress: Progress = Progress()


class RLHFJob(BaseModel):
    """An RL post-training job."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: Literal["rlhf.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLHFJob"]
    metadata: ObjectMeta
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None

    def to_config(self) -> dict[str, Any]:
        """The resolved job as JSON-ready data (camelCase), as mounted into every pod."""
        return self.model_dump(mode="json", by_alias=True, exclude={"status"})
