"""How a response is scored (`spec.reward`): the main reward function, its weighted
components, a learned reward model, an LLM judge, the code sandbox; what a python reward
function gets as `kwargs`."""

from __future__ import annotations

import keyword
from typing import Annotated, Any, Literal

from pydantic import Field, JsonValue, WithJsonSchema, field_validator, model_validator

from .common import INT32_MAX, MAX_SECONDS, SecretKeyRef, SpecModel
from .uris import ENV_SECRET, EndpointUrl, check_path

MAX_REWARD_WEIGHT = 1e6
"""Rewards are float32 (about 7 significant digits): beyond this a weight drowns every other term."""


class CodeSandboxSpec(SpecModel):
    """Where model-written programs run (`reward.type: code`) and their per-run limits."""

    url: EndpointUrl(ENV_SECRET, pattern=r"^https?://") | None = None
    """A sandbox service to use (this project's `rlhf_trainer.rewards.sandbox_service`);
    null: on a cluster the operator creates `<job>-sandbox`, locally the trainer runs programs
    itself with bubblewrap."""
    memory_mb: int = Field(default=512, ge=32, le=2**20)
    """Address space of each process of a run (MiB)."""
    max_processes: int = Field(default=4, ge=1, le=1024)
    """Processes and threads of one run together."""
    tmpfs_mb: int = Field(default=64, ge=1, le=2**20)
    """The run's only writable space, /tmp (MiB, counted in memory)."""
    max_output_kb: int = Field(default=1024, ge=1, le=2**20)
    """stdout and stderr are each cut here; a run that goes past it fails its case."""


class SandboxServiceSpec(SpecModel):
    """The pods that run model-written programs for `reward.type: code` on a cluster
    (`<job>-sandbox`), unless `reward.sandbox.url` names another service."""

    replicas: int = Field(default=1, ge=1, le=INT32_MAX)
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


class RewardModelSpec(SpecModel):
    """A learned reward model, scored in the trainer processes (laid out like the reference
    model: FSDP over the trainer's ranks, packed, no gradients)."""

    path: str = Field(min_length=1)
    """Directory of a Hugging Face sequence classifier with one label (what `method: rm`
    exports to `<output>/final`), or its `hf://` / `s3://` address as `model.path`; the
    score of a sequence is at its last token."""
    weight: float = Field(default=1.0, ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)
    """The step reward is the verifiable reward (0 for `type: model`) + weight x score."""

    @field_validator("path")
    @classmethod
    def _remote(cls, value: str) -> str:
        return check_path(value, "model")


DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the prompt below from {min_score} to {max_score} for correctness and "
    "helpfulness; the reference answer, when given, is correct.\n\nPrompt:\n{prompt}\n\nReference "
    "answer:\n{answer}\n\nResponse:\n{response}\n\nAnswer with the score alone, as a number.")
"""The default rubric of `reward.judge.template`."""


class JudgeSpec(SpecModel):
    """An LLM judge (`type: judge`): a served model reads `template` filled with the prompt,
    the response and the reference answer, and answers a score (a number in [minScore,
    maxScore], scaled to 0..1) or one of `choices`."""

    url: EndpointUrl("reward.judge.apiKeySecret", pattern=r"^https?://") | None = None
    """An OpenAI-compatible endpoint, up to its `/v1` (`https://api.example.com/v1`); null:
    the judge servers this job starts for `model` (`<job>-judge`; local mode starts them too)."""
    model: str = Field(min_length=1, max_length=1024)
    """The judge model: its name at `url`; without `url`, the Hugging Face model directory
    (in Kubernetes: on a mounted volume, or a built-in model in local mode) the job's judge
    servers serve."""
    api_key_secret: SecretKeyRef | None = None
    """The Secret key holding the endpoint's API key (RLHF_JUDGE_API_KEY in the trainer pods;
    locally the environment's RLHF_JUDGE_API_KEY)."""
    api: Literal["chat", "completions"] = "chat"
    """`chat`: POST /chat/completions with the rubric as one user turn; `completions`: POST
    /completions with the rubric as the prompt (base models)."""
    template: str = Field(default=DEFAULT_JUDGE_TEMPLATE, min_length=1)
    """The rubric, with the placeholders {prompt}, {response}, {answer}, {min_score} and
    {max_score} (a chat prompt is its turns as `role: content` lines)."""
    min_score: float = 0.0
    """Lowest score the rubric asks for (reward 0)."""
    max_score: float = 10.0
    """Highest score the rubric asks for (reward 1); a number outside the range is unparsable."""
    choices: dict[str, float] = {}
    """A choice judge: each answer word and its reward (`{"yes": 1, "no": 0}`); the answer must
    be exactly one of them (case-insensitive), anything else is a parse failure; empty: a
    number is expected."""
    max_tokens: int = Field(default=32, ge=1, le=INT32_MAX)
    """Tokens the judge may answer with."""
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    """The judge's sampling temperature."""
    max_concurrency: int = Field(default=16, ge=1, le=1024)
    """Judge requests in flight at once."""
    max_retries: int = Field(default=2, ge=0, le=10)
    """Retries of a request that failed to connect, timed out or got 429 / 5xx, with backoff;
    then the step fails (a judge that answers is scored, one that cannot be reached is not)."""
    replicas: int = Field(default=1, ge=1, le=INT32_MAX)
    """Without `url`: judge servers the job starts (each like a rollout server:
    rollout.gpusPerReplica GPUs, rollout.image)."""

    @model_validator(mode="after")
    def _scores_and_template(self) -> "JudgeSpec":
        if not self.choices and not self.min_score < self.max_score:
            raise ValueError(f"judge.minScore ({self.min_score}) must be below judge.maxScore ({self.max_score})")
        try:
            self.template.format(prompt="", response="", answer="", min_score=0, max_score=1)
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"judge.template: {type(err).__name__} {err}; its placeholders are {{prompt}}, "
                             "{response}, {answer}, {min_score} and {max_score} (write {{ and }} for braces)") from None
        return self


REWARD_ARGUMENTS = frozenset({
    "prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra",  # TRL's
    "data_source", "solution_str", "ground_truth", "extra_info",  # veRL's
    "response", "answer",  # ours
})
"""Keywords the trainer itself passes to a python reward function: not allowed in `kwargs`."""
RewardKwargs = Annotated[dict[str, JsonValue], WithJsonSchema(
    {"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
"""A free-form JSON object, kept as written (the CRD keeps its unknown fields)."""


RewardType = Literal["exact_match", "prefix_match", "math", "code", "python", "http", "judge"]


class RewardFunctionSpec(SpecModel):
    """One reward function: how a response is scored into `reward` (used for advantages)
    and `score` (logged); the built-in ones return the same number for both."""

    file: str | None = None
    """`python`: path of the file defining the reward function (null: `function` is an
    import path)."""
    function: str = Field(default="reward_fn", min_length=1, max_length=512)
    """`python`: the function's name in `file`, or without `file` an import path of a package
    installed in the trainer image, dotted as TRL's CLI takes it (`my_pkg.rewards.accuracy`,
    TRL's own `trl.rewards.accuracy_reward`, `trl.rewards.think_format_reward`) or
    `package.module:function`; a `trl.rewards.get_*` factory is called with `kwargs`. Its
    parameters pick the form (docs/methods.md): TRL's batched `(prompts, completions,
    completion_ids, **columns)` with `trainer_state`, `log_metric` and `log_extra` as TRL
    passes them, veRL's `compute_score(data_source, solution_str, ground_truth, extra_info)`,
    or `fn(response, answer, extra_info) -> float | {reward, score}`; None or NaN for a
    response means "does not apply"."""
    kwargs: RewardKwargs = {}
    """`python`: further keyword arguments for every call of the function (veRL's
    `reward_kwargs`), any JSON values, e.g. `{max_len: 512, strict: true}`."""
    url: EndpointUrl(ENV_SECRET) | None = None
    """`http`: endpoint that answers {prompt, response, answer, extra_info} with {reward, score}."""
    timeout_seconds: float = Field(default=10.0, gt=0, le=MAX_SECONDS)
    """`code`: wall-clock limit per test case; `math`: per answer; `http` and `judge`: per request."""
    judge: JudgeSpec | None = None
    """`judge`: the judge model, its endpoint and its rubric."""
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

    @field_validator("kwargs")
    @classmethod
    def _keyword_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not k.isidentifier() or keyword.iskeyword(k)]
        if bad:
            raise ValueError(f"keys {bad} are not Python keyword-argument names")
        taken = sorted(REWARD_ARGUMENTS & set(value))
        if taken:
            raise ValueError(f"keys {taken} are passed by the trainer itself; rename them")
        return value


class RewardComponentSpec(RewardFunctionSpec):
    """A further reward function whose weighted reward is added to the main one (a format
    reward beside a correctness reward, a service's score, ...)."""

    name: str = Field(max_length=40, pattern=r"^[a-z][a-z0-9_]{0,39}$")
    """Its name in the metrics: `reward/<name>_mean` (before weighting), Prometheus
    `rlhf_reward_component_mean{component="<name>"}`."""
    type: RewardType
    """As `reward.type` (not `model`: a reward model is `reward.model`)."""
    weight: float = Field(default=1.0, ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)
    """The trained reward adds weight x this component's reward."""


class RewardSpec(RewardFunctionSpec):
    """How a response is scored: the main reward function (`type` and its fields), optional
    weighted `components`, and an optional learned reward `model`. The trained reward is the
    main reward + each component's weight x its reward + model.weight x the model's score;
    the logged `score` is the main function's."""

    type: Literal["exact_match", "prefix_match", "math", "code", "python", "http", "judge", "model"] = "exact_match"
    """`exact_match` / `prefix_match`: the stripped response equals / starts with the answer;
    `math`: the final boxed or <answer> answer is equivalent to the answer (math-verify);
    `code`: the last fenced Python block passes the row's `test_cases` in a sandbox;
    `python`: `function` from the user file `file` or an import path; `http`: POST to `url`;
    `judge`: an LLM judge (`judge`); `model`: the reward model `model` alone."""
    name: str | None = Field(default=None, max_length=40, pattern=r"^[a-z][a-z0-9_]{0,39}$")
    """The main function's name in the metrics when there are `components` (default: its type)."""
    components: list[RewardComponentSpec] = Field(default=[], max_length=8)
    """Further reward functions, weighted and added to the main one; each is logged."""
    model: RewardModelSpec | None = None
    """A reward model whose weighted score is added to the reward (required by `type: model`;
    with another type the two are combined)."""

    @property
    def main_name(self) -> str:
        return self.name or self.type

    def functions(self) -> list[RewardFunctionSpec]:
        """The main function (unless `type: model`) and the components."""
        return ([self] if self.type != "model" else []) + list(self.components)

    def uses(self, reward_type: str) -> bool:
        """Whether the main function or a component is of this type."""
        return self.type == reward_type or any(c.type == reward_type for c in self.components)
