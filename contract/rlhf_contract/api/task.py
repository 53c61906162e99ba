"""What a job learns from: the model, the data, the multi-turn environment, the RL algorithm;
the reward (verifiable, code in a sandbox, Python, HTTP, a judge, a learned reward model) is
`reward.py`'s, re-exported here."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .common import INT32_MAX, SpecModel
from .reward import (MAX_REWARD_WEIGHT, CodeSandboxSpec, JudgeSpec, RewardComponentSpec,  # noqa: F401  (re-exported)
                     RewardFunctionSpec, RewardModelSpec, RewardSpec, RewardType, SandboxServiceSpec)
from .uris import CONFIG_NAME, check_config, check_path

LORA_DEFAULT_TARGETS = "all-linear"


class LoraSpec(SpecModel):
    """LoRA adapters (peft's `LoraConfig`): only the adapters train and have optimizer state;
    the reference model is the base itself (adapters off); checkpoints hold the adapters;
    the rollout servers receive merged weights."""

    rank: int = Field(default=16, ge=1, le=1024)
    """The adapters' rank r."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the update is (alpha / rank) x B A."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training."""
    target_modules: list[str] = Field(default_factory=lambda: [LORA_DEFAULT_TARGETS], min_length=1)
    """Linear layers that get adapters, by name suffix (`q_proj`, `v_proj`, ...), or
    `all-linear`: every linear layer but the output head (and a score head)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules that train whole beside the adapters (peft's `modules_to_save`), by name
    suffix, e.g. `lm_head`: a copy trains, the reference keeps the original."""


class ModelSpec(SpecModel):
    """The policy model to train."""

    path: str = Field(min_length=1)
    """Hugging Face model directory (in Kubernetes: a path on a mounted volume), a Hub
    repository `hf://<org>/<name>[@<revision>][/<subfolder>]` (only the files
    `from_pretrained` reads: safetensors weights, configs, tokenizer, chat template), an S3
    location `s3://<bucket>/<prefix>` (both downloaded once per job before anything
    starts), or a built-in model: `builtin://tiny-qwen2` (or `builtin://tiny-qwen2-hd32`;
    `builtin://tiny-qwen2-tools` has a chat template that renders tools, for `rollout.tools`)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for the rollout servers (`vllm serve --dtype`)."""
    lora: LoraSpec | None = None
    """Train low-rank adapters on the frozen model instead of every weight (null: full
    training)."""

    @field_validator("path")
    @classmethod
    def _remote(cls, value: str) -> str:
        return check_path(value, "model")


class DatasetSource(SpecModel):
    """The checks of a dataset's `path` and `config` (Hub subset), for every model that names
    a dataset; each declares the two fields itself, `path` first (so `config`'s check sees it)."""

    @field_validator("path", check_fields=False)
    @classmethod
    def _remote(cls, value: str) -> str:
        return check_path(value, "dataset")

    @field_validator("config", check_fields=False)
    @classmethod
    def _config_applies(cls, value: str | None, info: ValidationInfo) -> str | None:
        return check_config(value, info.data.get("path", ""))


class DataSpec(DatasetSource):
    """Where prompts come from."""

    path: str = Field(min_length=1)
    """A local dataset (in Kubernetes: on a mounted volume): a JSON, JSONL, CSV, Parquet or
    Arrow file, a directory of them, a `save_to_disk` directory, or a Hub dataset
    repository's snapshot (a README.md with `configs:`); a Hub dataset repository
    `hf://[datasets/]<org>/<name>[@<revision>]` (read as `datasets.load_dataset` reads it,
    with `config` and `split`; only their files are downloaded), a file or folder in one
    `hf://datasets/<org>/<name>[@<revision>]/<path>`, or an S3 location
    `s3://<bucket>/<prefix>` holding them (downloaded once per job); or a built-in task:
    `builtin://last-digit`, `builtin://sum-mod-10`."""
    config: str | None = Field(default=None, min_length=1, max_length=128, pattern=CONFIG_NAME)
    """The config of a Hub dataset repository (`main` or `socratic` of gsm8k: its README's
    `configs:`); null: the repository's default (its only config, or the one marked
    `default`)."""
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
    max_prompt_length: int = Field(default=1024, ge=1, le=INT32_MAX)
    """Prompts longer than this many tokens are dropped (the count is logged)."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by `schedule.seed`)."""
    response_key: str = "response"
    """`method: sft`: column of the response text (with `promptKey`; or `messagesKey` turns)."""
    chosen_key: str = "chosen"
    """`method: rm` / `dpo`: column of the preferred response (text or an assistant message)."""
    rejected_key: str = "rejected"
    """`method: rm` / `dpo`: column of the dispreferred response."""


class TeacherSpec(SpecModel):
    """The teacher of `method: distill`: frozen, scored in the trainer processes like the
    reference model (laid out over the trainer's ranks, packed, no gradients)."""

    path: str = Field(min_length=1)
    """Directory of a Hugging Face causal LM (in Kubernetes: on a mounted volume), e.g. the
    `final/` of a trained run; its tokenizer must be the student's (preflight compares them)."""


class DistillationSpec(SpecModel):
    """On-policy distillation (`method: distill`): the student (`model`) samples, the
    teacher scores each sampled token, and each token's advantage is the negative
    reverse-KL estimate log p_teacher - log p_student, optionally plus a task reward's."""

    teacher: TeacherSpec
    """The teacher model."""
    reward_weight: float = Field(default=0.0, ge=0, le=MAX_REWARD_WEIGHT)
    """Weight of the task reward: each token's advantage adds this x the advantage of the
    sequence's reward (`reward`, by `algorithm.advantageEstimator`); 0: the teacher alone
    (the reward is still computed and logged)."""
    baseline: Literal["none", "position"] = "none"
    """Subtracted from each token's teacher signal (not from the task reward's part):
    `none` (the raw log p_teacher - log p_student, as the Thinking Machines recipe, prime-rl
    and slime use it) or `position` (the mean signal of the step's other tokens at the same
    response position, leave-one-out). A baseline that does not depend on the sampled token
    keeps the gradient unbiased and lowers its variance: an untrained student far from its
    teacher gets mostly large negative signals, and without it stalls (docs/methods.md)."""


class EnvironmentSpec(SpecModel):
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
PolicyLoss = Literal["ppo", "gspo", "cispo"]


CorrectionMode = Literal["tis", "token-mask", "sequence-mask", "two-sided-mask"]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
MASK_MODES = ("token-mask", "sequence-mask", "two-sided-mask")
"""The modes that zero a token's loss outside [lower, upper] (they need `upper`)."""
DEFAULT_TIS_UPPER = 2.0
"""`upper` of `mode: tis` when unset (and of a job with `rollout.maxStaleness` >= 1 that sets
no correction): the cap veRL and the TIS post's examples use."""


class RolloutCorrectionSpec(SpecModel):
    """The importance correction between the rollout engine's log-probs and the trainer's
    (`old`, before this step's updates), per response token with ratio
    rho = exp(old - rollout): each token's policy loss is multiplied by a detached weight w.
    `tis`: w = min(rho, upper) (truncated). `token-mask`: w = rho where lower <= rho <= upper,
    else 0 (the token is masked out of the loss). `sequence-mask`: the sequence's ratio
    rho_seq = exp(mean over its tokens of old - rollout) (the geometric mean of its token
    ratios), w = rho_seq on every token of a sequence with lower <= rho_seq <= upper, else 0.
    `two-sided-mask` (IcePop): `token-mask` with both bounds required. A masked token still
    counts in `lossAgg`'s denominators (docs/methods.md)."""

    mode: CorrectionMode = "tis"
    """`tis`, `token-mask`, `sequence-mask` or `two-sided-mask`."""
    upper: float | None = Field(default=None, gt=0)
    """`tis`: the cap on the weight (2.0 when unset); the masks: the largest ratio kept
    (required, at least 1)."""
    lower: float | None = Field(default=None, gt=0)
    """The masks: the smallest ratio kept (at most 1; required by `two-sided-mask`; unset:
    no lower bound); not used by `tis`."""

    @model_validator(mode="after")
    def _tis_default(self) -> "RolloutCorrectionSpec":
        if self.mode == "tis" and self.upper is None:
            self.upper = DEFAULT_TIS_UPPER
        return self


class AlgorithmSpec(SpecModel):
    """The RL algorithm. `preset` sets the defaults of every field left unset (null);
    see presets.py and the preset table in docs/reference.md."""

    preset: Literal["ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo",
                    "cispo"] = "grpo"
    """A named algorithm whose settings fill every field you leave unset."""
    advantage_estimator: Estimator | None = None
    """How advantages are computed: gae (PPO, needs the critic), grpo, dr_grpo, rloo,
    reinforce_pp, reinforce_pp_baseline."""
    norm_std: bool | None = None
    """grpo: divide by the group's std; gae: whiten advantages over the batch."""
    loss_agg: LossAgg | None = None
    """How per-token losses are reduced: token-mean, seq-mean-token-mean,
    seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO)."""
    policy_loss: PolicyLoss | None = None
    """The policy objective: `ppo` (the clipped token ratio, PPO / GRPO / DAPO ...), `gspo`
    (GSPO: one length-normalised ratio per sequence, exp(mean over its tokens of
    logp - old), clipped at the sequence level) or `cispo` (CISPO: the token ratio clipped
    and detached, times the advantage, times the token log-prob: every token keeps its
    gradient)."""
    clip_low: float | None = Field(default=None, ge=0)
    """Ratio clip below 1: ratio >= 1 - clipLow (gspo: the sequence ratio; cispo: the
    importance weight, 1 or more: no lower bound)."""
    clip_high: float | None = Field(default=None, ge=0)
    """Ratio clip above 1: ratio <= 1 + clipHigh (DAPO's clip-higher: 0.28; gspo: the
    sequence ratio, 4e-4; cispo: the importance weight's cap)."""
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
    rollout_correction: RolloutCorrectionSpec | None = None
    """Importance correction against the rollout engine's log-probs: truncated (`tis`) or
    masked (`token-mask`, `sequence-mask`, `two-sided-mask`) weights; null: none (with
    rollout.maxStaleness >= 1 the trainer config resolves null to `tis` with upper 2.0)."""
    tis_cap: float | None = Field(default=None, gt=0)
    """Deprecated: the same as `rolloutCorrection: {mode: tis, upper: <tisCap>}` (which the
    trainer config resolves it to); set one or the other, not both."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of an entropy bonus in the policy loss."""
    num_mini_batches: int | None = Field(default=None, ge=1)
    """Optimizer steps per RL step; the step's samples are split into this many parts
    (the gspo preset: 4, as the GSPO paper)."""

    def correction(self) -> RolloutCorrectionSpec | None:
        """The correction this algorithm asks for: `rolloutCorrection`, or the deprecated
        `tisCap` as `tis` with that cap, or None."""
        if self.rollout_correction is not None or self.tis_cap is None:
            return self.rollout_correction
        return RolloutCorrectionSpec(mode="tis", upper=self.tis_cap)
