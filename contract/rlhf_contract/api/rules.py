"""Cross-field rules of the job spec, each checked twice from one definition.

Every rule has a Python check (used by pydantic validation, `rlhfctl validate` and the
trainer's preflight, which checks them against its real world size) and a CEL expression
that `rlhfctl crd` puts into the CRD, so the API server rejects the same specs at
`kubectl apply` with the same field path and message. Single-field bounds (a count of at
least 1) live on the fields themselves, not here.
"""

from __future__ import annotations

from typing import Any

from .common import Method
from .presets import cel_resolved
from .rule import Rule, required_for_component, required_for_reward  # noqa: F401  (re-exported)
from .rules_algorithm import CORRECTION_RULES
from .rules_rollout import AGENT_RULES, CLUSTER_RULES, COLOCATED_RULES, ONLINE_CEL  # noqa: F401  (re-exported)

ESTIMATOR = cel_resolved("advantage_estimator", "advantageEstimator")
CRITIC = cel_resolved("critic", "critic")
OVERLONG = cel_resolved("overlong_buffer", "overlongBuffer")
DYNAMIC = cel_resolved("dynamic_sampling", "dynamicSampling")
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
_TP = "(has(self.trainer.parallelism) && has(self.trainer.parallelism.tensorParallel) ? self.trainer.parallelism.tensorParallel : 1)"
_CP = "(has(self.trainer.parallelism) && has(self.trainer.parallelism.contextParallel) ? self.trainer.parallelism.contextParallel : 1)"
_ALGO_MINI = cel_resolved("num_mini_batches", "numMiniBatches")
POLICY_LOSS = cel_resolved("policy_loss", "policyLoss")
_RM, _DISTILL = f"'{Method.RM}'", f"'{Method.DISTILL}'"
_ONLINE = ONLINE_CEL
KL_COEF = cel_resolved("kl_coef", "klCoef")



def _SERVED(f: str) -> str:  # noqa: N802 (reads as a CEL macro)
    """CEL: reward function `f` is a judge the job serves (no judge.url)."""
    return f"({f}.type == 'judge' && has({f}.judge) && !has({f}.judge.url))"


def _import_path(function: str) -> bool:
    """reward.function without a file: package.module.function or package.module:function."""
    return ":" in function or "." in function


_MAIN_NAME = "(has(self.reward.name) ? self.reward.name : self.reward.type)"

TP_WITH_CRITIC = Rule(
    field_path="trainer.parallelism.tensorParallel",
    cel=f"!{_ONLINE} || !{CRITIC} || {_TP} == 1",
    message="must be 1 with algorithm.critic (the value model is not tensor parallel yet); use data or "
    "context parallelism (trainer.nprocPerNode, trainer.parallelism.contextParallel)",
    check=lambda s: s.offline or not s.algorithm.critic or s.trainer.parallelism.tensor_parallel == 1,
    detail=lambda s: f"got {s.trainer.parallelism.tensor_parallel}",
)
TP_WITH_REWARD_MODEL = Rule(
    field_path="trainer.parallelism.tensorParallel",
    cel=f"!{_ONLINE} || !has(self.reward.model) || {_TP} == 1",
    message="must be 1 with reward.model (the reward model is not tensor parallel yet); use data or "
    "context parallelism (trainer.nprocPerNode, trainer.parallelism.contextParallel)",
    check=lambda s: s.offline or s.reward.model is None or s.trainer.parallelism.tensor_parallel == 1,
    detail=lambda s: f"got {s.trainer.parallelism.tensor_parallel}",
)


RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.topP",
        cel=f"!{_ONLINE} || (self.rollout.topP == 1.0 && self.rollout.topK <= 0)",
        message="must be 1 and rollout.topK -1: the servers return log-probs of the truncated distribution "
        "they sample from, the trainer computes them over the whole vocabulary (temperature only), so "
        "their importance ratio would be biased; sample with rollout.temperature alone",
        check=lambda s: s.offline or (s.rollout.top_p == 1.0 and s.rollout.top_k <= 0),
        detail=lambda s: f"got topP={s.rollout.top_p}, topK={s.rollout.top_k}",
    ),
    Rule(
        field_path="rollout.samplesPerPrompt",
        cel=f"self.rollout.samplesPerPrompt >= 2 || !({ESTIMATOR} in {list(GROUP_ESTIMATORS)})",
        message="must be at least 2 with a group advantage estimator (grpo, dr_grpo, rloo, "
        "reinforce_pp_baseline): they compare the samples of one prompt",
        check=lambda s: s.rollout.samples_per_prompt >= 2 or s.algorithm.advantage_estimator not in GROUP_ESTIMATORS,
        detail=lambda s: f"got {s.rollout.samples_per_prompt} with {s.algorithm.advantage_estimator}",
    ),
    Rule(
        field_path="algorithm.critic",
        cel=f"({ESTIMATOR} == 'gae') == {CRITIC}",
        message="must be true exactly when algorithm.advantageEstimator is gae (only GAE uses "
        "the value model)",
        check=lambda s: (s.algorithm.advantage_estimator == "gae") == s.algorithm.critic,
        detail=lambda s: f"critic={s.algorithm.critic}, advantageEstimator={s.algorithm.advantage_estimator}",
    ),
    Rule(
        field_path="reward.file",
        # `function` is a CEL reserved word: Kubernetes names the property __function__
        cel="self.reward.type != 'python' || has(self.reward.file) || "
        "(has(self.reward.__function__) && (self.reward.__function__.contains(':') || "
        "self.reward.__function__.contains('.')))",
        message="is required when reward.type is python, unless reward.function is an import path "
        "(package.module.function, e.g. trl.rewards.accuracy_reward, or package.module:function)",
        check=lambda s: s.reward.type != "python" or bool(s.reward.file) or _import_path(s.reward.function),
    ),
    required_for_reward("judge", "judge", "the judge model and its rubric"),
    required_for_reward("model", "model", "the reward model's directory, reward.model.path"),
    Rule(
        field_path="algorithm.dynamicSampling",
        cel=f"!has(self.reward.model) || !{DYNAMIC}",
        message="cannot be true with reward.model: groups are filtered before the trainers score them "
        "with the reward model; use a preset without dynamic sampling or set dynamicSampling: false",
        check=lambda s: s.reward.model is None or not s.algorithm.dynamic_sampling,
    ),
    Rule(
        field_path="environment",
        cel="!has(self.environment) || (has(self.environment.file) != has(self.environment.gem))",
        message="needs exactly one of environment.file (a Python step function) and environment.gem "
        "(a GEM environment id)",
        check=lambda s: s.environment is None or ((s.environment.file is None) != (s.environment.gem is None)),
    ),
    Rule(
        field_path="rollout.tools",
        cel="!has(self.rollout.tools) || !has(self.environment)",
        message="cannot be set with spec.environment: an episode is either model turns and tool messages "
        "(rollout.tools, scored by spec.reward) or a step environment's turns; remove one of the two",
        check=lambda s: s.rollout.tools is None or s.environment is None,
    ),
    Rule(
        field_path="data.path",
        cel="(self.data.path == 'builtin://gem') == (has(self.environment) && has(self.environment.gem))",
        message="is builtin://gem exactly when environment.gem is set (a GEM environment's reset "
        "observations are the prompts)",
        check=lambda s: (s.data.path == "builtin://gem") == (s.environment is not None and s.environment.gem is not None),
    ),
    required_for_reward("http", "url", "the reward service endpoint"),
    *COLOCATED_RULES,
    *AGENT_RULES,
    *CORRECTION_RULES,
    Rule(
        field_path="reward.components",
        cel="!has(self.reward.components) || self.reward.components.all(c, c.type != 'python' || has(c.file) || "
        "(has(c.__function__) && (c.__function__.contains(':') || c.__function__.contains('.'))))",
        message="each component of type python needs file (the file defining the reward function) or a "
        "function that is an import path (package.module.function or package.module:function)",
        check=lambda s: all(c.type != "python" or bool(c.file) or _import_path(c.function) for c in s.reward.components),
        detail=lambda s: "missing on " + ", ".join(c.name for c in s.reward.components
                                                  if c.type == "python" and not c.file and not _import_path(c.function)),
    ),
    required_for_component("judge", "judge", "the judge model and its rubric"),
    Rule(
        field_path="reward",
        cel=f"!has(self.reward.components) || self.reward.components.all(c, !{_SERVED('c')} || "
        f"((!{_SERVED('self.reward')} || self.reward.judge.model == c.judge.model) && "
        f"self.reward.components.all(d, !{_SERVED('d')} || d.judge.model == c.judge.model)))",
        message="judges without judge.url must all name the same judge.model: the job serves one judge model",
        check=lambda s: len({f.judge.model for f in s.reward.functions()
                             if f.type == "judge" and f.judge is not None and not f.judge.url}) <= 1,
    ),
    required_for_component("http", "url", "the reward service endpoint"),
    Rule(
        field_path="reward.components",
        cel="!has(self.reward.components) || self.reward.components.all(c, c.name != "
        f"{_MAIN_NAME} && self.reward.components.exists_one(d, d.name == c.name))",
        message="names must be unique and differ from the main reward's name (reward.name, default "
        "reward.type): they name the logged reward/<name>_mean",
        check=lambda s: len({c.name for c in s.reward.components} | {s.reward.main_name})
        == len(s.reward.components) + 1,
        detail=lambda s: f"names {[s.reward.main_name] + [c.name for c in s.reward.components]}",
    ),
    Rule(
        field_path="reward.components",
        cel="!has(self.environment) || !has(self.reward.components) || size(self.reward.components) == 0",
        message="cannot be used with environment: a multi-turn environment gives the rewards",
        check=lambda s: s.environment is None or not s.reward.components,
    ),
    Rule(
        field_path="algorithm.overlongBuffer",
        cel=f"{OVERLONG} < self.rollout.maxTokens",
        message="must be smaller than rollout.maxTokens (it is the stretch before maxTokens "
        "where long responses are penalised)",
        check=lambda s: s.algorithm.overlong_buffer < s.rollout.max_tokens,
        detail=lambda s: f"{s.algorithm.overlong_buffer} >= {s.rollout.max_tokens}",
    ),
    Rule(
        field_path="algorithm.dualClip",
        cel=f"{POLICY_LOSS} != 'cispo' || !has(self.algorithm) || !has(self.algorithm.dualClip)",
        message="cannot be used with policyLoss cispo: the dual clip bounds PPO's clipped objective, and "
        "CISPO has none (it clips the detached importance weight, clipHigh); remove dualClip",
        check=lambda s: s.algorithm.policy_loss != "cispo" or s.algorithm.dual_clip is None,
    ),
    Rule(
        field_path="distillation",
        cel=f"(self.method == {_DISTILL}) == has(self.distillation)",
        message="is set exactly when method is distill (it names the teacher that scores the student's tokens)",
        check=lambda s: (s.method == Method.DISTILL) == (s.distillation is not None),
        detail=lambda s: f"method {s.method}",
    ),
    Rule(
        field_path="algorithm.klCoef",
        cel=f"self.method != {_DISTILL} || {KL_COEF} == 0.0",
        message="must be 0 with method distill: the teacher's reverse KL is the signal, and the frozen model "
        "the trainer scores with is the teacher, not the starting model (unset resolves to 0 for distill)",
        check=lambda s: s.method != Method.DISTILL or not s.algorithm.kl_coef,
        detail=lambda s: f"got {s.algorithm.kl_coef}",
    ),
    Rule(
        field_path="algorithm.dynamicSampling",
        cel=f"self.method != {_DISTILL} || !{DYNAMIC}",
        message="must be false with method distill: every token carries the teacher's signal, so a group "
        "whose rewards are all equal is not uninformative; use a preset without it or set it false",
        check=lambda s: s.method != Method.DISTILL or not s.algorithm.dynamic_sampling,
    ),
    Rule(
        field_path="algorithm.critic",
        cel=f"self.method != {_DISTILL} || !{CRITIC}",
        message="must be false with method distill (no value model: the advantages are the teacher's "
        "per-token signal); use an advantage estimator other than gae for distillation.rewardWeight",
        check=lambda s: s.method != Method.DISTILL or not s.algorithm.critic,
    ),
    Rule(
        field_path="trainer.parallelism",
        cel=f"(self.trainer.numNodes * self.trainer.nprocPerNode) % ({_TP} * {_CP}) == 0",
        message="tensorParallel x contextParallel must divide the trainer world size "
        "(trainer.numNodes x trainer.nprocPerNode)",
        check=lambda s: s.trainer_world_size % (s.trainer.parallelism.tensor_parallel * s.trainer.parallelism.context_parallel) == 0,
        detail=lambda s: f"{s.trainer.parallelism.tensor_parallel} x {s.trainer.parallelism.context_parallel} "
        f"does not divide {s.trainer_world_size}",
    ),
    Rule(
        field_path="trainer.maxTokensPerMicroBatch",
        cel=f"!{_ONLINE} || self.trainer.maxTokensPerMicroBatch >= self.data.maxPromptLength + self.rollout.maxTokens",
        message="must hold the longest possible sequence, data.maxPromptLength + rollout.maxTokens "
        "(a micro-batch packs whole sequences); raise it or lower those two",
        check=lambda s: s.offline or s.trainer.max_tokens_per_micro_batch >= s.data.max_prompt_length + s.rollout.max_tokens,
        detail=lambda s: f"{s.trainer.max_tokens_per_micro_batch} < {s.data.max_prompt_length} + {s.rollout.max_tokens}",
    ),
    Rule(
        field_path="algorithm.numMiniBatches",
        cel=f"(self.schedule.promptsPerStep * self.rollout.samplesPerPrompt) % {_ALGO_MINI} == 0",
        message="must divide schedule.promptsPerStep x rollout.samplesPerPrompt (the samples of one step)",
        check=lambda s: s.samples_per_step % s.algorithm.num_mini_batches == 0,
        detail=lambda s: f"{s.algorithm.num_mini_batches} does not divide {s.samples_per_step} samples",
    ),
    Rule(
        field_path="trainer.parallelism.contextParallel",
        cel=f"{_ONLINE} || {_CP} == 1",
        message="must be 1 for method sft, rm and dpo (context parallelism is for RL's long rollouts); "
        "use data parallelism (trainer.nprocPerNode) instead",
        check=lambda s: not s.offline or s.trainer.parallelism.context_parallel == 1,
        detail=lambda s: f"got {s.trainer.parallelism.context_parallel} with method {s.method}",
    ),
    Rule(
        field_path="trainer.parallelism.tensorParallel",
        cel=f"self.method != {_RM} || {_TP} == 1",
        message="must be 1 for method rm (the reward model's score head is not tensor parallel yet); "
        "use data parallelism (trainer.nprocPerNode) instead",
        check=lambda s: s.method != Method.RM or s.trainer.parallelism.tensor_parallel == 1,
        detail=lambda s: f"got {s.trainer.parallelism.tensor_parallel}",
    ),
    TP_WITH_CRITIC,
    TP_WITH_REWARD_MODEL,
    Rule(
        field_path="trainer.parallelism.tensorParallel",
        cel=f"!has(self.model.lora) || {_TP} == 1",
        message="must be 1 with model.lora (adapters are not tensor parallel yet); use data or context "
        "parallelism (trainer.nprocPerNode, trainer.parallelism.contextParallel), or full training",
        check=lambda s: s.model.lora is None or s.trainer.parallelism.tensor_parallel == 1,
        detail=lambda s: f"got {s.trainer.parallelism.tensor_parallel}",
    ),
    Rule(
        field_path="trainer.engine",
        cel=f"!has(self.trainer.engine) || self.trainer.engine != 'deepspeed' || ({_TP} == 1 && {_CP} == 1)",
        message="deepspeed is data parallel only: set trainer.parallelism.tensorParallel and contextParallel to 1, "
        "or use engine fsdp2",
        check=lambda s: s.trainer.engine != "deepspeed" or (s.trainer.parallelism.tensor_parallel == 1
                                                            and s.trainer.parallelism.context_parallel == 1),
        detail=lambda s: (f"got tensorParallel {s.trainer.parallelism.tensor_parallel}, contextParallel "
                          f"{s.trainer.parallelism.context_parallel}"),
    ),
    Rule(
        field_path="trainer.engine",
        cel="!has(self.trainer.engine) || self.trainer.engine != 'deepspeed' || !has(self.model.lora)",
        message="model.lora trains with engine fsdp2 only (the adapters under ZeRO are not supported yet); "
        "remove model.lora or use engine fsdp2",
        check=lambda s: s.trainer.engine != "deepspeed" or s.model.lora is None,
    ),
    Rule(
        field_path="trainer.deepspeed.offloadParams",
        cel="!has(self.trainer.deepspeed) || !has(self.trainer.deepspeed.offloadParams) "
            "|| !self.trainer.deepspeed.offloadParams || (has(self.trainer.deepspeed.zeroStage) "
            "? self.trainer.deepspeed.zeroStage : 3) == 3",
        message="parameter offload needs ZeRO stage 3: set trainer.deepspeed.zeroStage: 3 or offloadParams: false",
        check=lambda s: not s.trainer.deepspeed.offload_params or s.trainer.deepspeed.zero_stage == 3,
    ),
    Rule(
        field_path="evaluation.datasets",
        cel=f"{_ONLINE} || !has(self.evaluation) || !has(self.evaluation.datasets) "
            "|| size(self.evaluation.datasets) == 0",
        message="prompt sets scored through the rollout servers are for method rl; sft, rm and dpo score "
        "the held-out fraction of data.path: set evaluation.heldOutFraction instead",
        check=lambda s: not s.offline or s.evaluation is None or not s.evaluation.datasets,
        detail=lambda s: f"method {s.method}",
    ),
    Rule(
        field_path="evaluation.heldOutFraction",
        cel=f"!{_ONLINE} || !has(self.evaluation) || !has(self.evaluation.heldOutFraction) "
            "|| self.evaluation.heldOutFraction == 0.0",
        message="is for the offline methods (sft, rm, dpo); method rl scores held-out prompt sets: "
        "set evaluation.datasets instead",
        check=lambda s: s.offline or s.evaluation is None or not s.evaluation.held_out_fraction,
        detail=lambda s: f"got {s.evaluation.held_out_fraction}" if s.evaluation else "",
    ),
)

RL_ONLY_FIELDS: tuple[str, ...] = ("reward", "environment", "algorithm", "rollout", "sandboxService")
"""Spec fields that only `method: rl` and `distill` read: a job file of another method that sets one is
refused naming it (`load.validate_job`; on a cluster the API server's defaults fill them in,
so the operator only ignores them)."""


MUTABLE_FIELDS: tuple[str, ...] = ("suspend", "runPolicy")
"""Spec fields an update may change: the operator acts on them at once (suspend scales
everything to zero; runPolicy's budget, deadline and TTL are read on every reconcile)."""

IMMUTABLE_FIELDS: tuple[str, ...] = ("method", "model", "data", "reward", "environment", "algorithm", "distillation",
                                     "rollout",
                                     "trainer", "schedule", "output", "pod", "sandboxService", "preference",
                                     "evaluation", "backend", "tracking", "storageSecret", "sourceCache")
"""Spec fields (YAML names under spec) that an update may not change. Each is read once,
when the pods start (the config file, the trainer's world and endpoints, the servers'
command line), so a change on a running job would be half-applied. The CRD carries one
CEL transition rule (`oldSelf`) per field, naming it; every spec field is in exactly one
of MUTABLE_FIELDS and IMMUTABLE_FIELDS (a unit test checks)."""


def immutable_cel(field: str) -> str:
    """The transition rule for one immutable spec field (absent stays absent)."""
    return (f"has(self.{field}) == has(oldSelf.{field}) && "
            f"(!has(self.{field}) || self.{field} == oldSelf.{field})")


_OFFLINE_CEL = "(has(object.spec.method) && object.spec.method in [" + ", ".join(
    f"'{m}'" for m in Method if m.offline) + "])"
_COLOCATED_CEL = ("(has(object.spec.rollout) && has(object.spec.rollout.placement) && "
                  "object.spec.rollout.placement == 'colocated')")

QUEUE_LABEL_BACKEND = Rule(
    field_path="backend",
    cel=("object.metadata.?labels[?'kueue.x-k8s.io/queue-name'].orValue('') == '' || "
         "!has(object.spec.backend) || object.spec.backend == 'JobSet' || "
         f"(object.spec.backend == 'TrainJob' && ({_OFFLINE_CEL} || {_COLOCATED_CEL}))"),
    message="on a job with the label kueue.x-k8s.io/queue-name must be JobSet (or unset: JobSet), or TrainJob "
    "when the trainer's pods are the job's only pods (method sft, rm or dpo, or rollout.placement colocated): "
    "Kueue admits a JobSet or a TrainJob whole, not a PyTorchJob, nor the rollout StatefulSet beside a "
    "TrainJob; use spec.backend JobSet or TrainJob, or drop the label",
    check=lambda job: (not (job.metadata.labels or {}).get("kueue.x-k8s.io/queue-name")
                       or job.spec.backend == "JobSet"
                       or (job.spec.backend == "TrainJob" and job.spec.trainer_pods_only)),
    detail=lambda job: (f"got {job.spec.backend}" + ("" if job.spec.backend != "TrainJob" else
                                                     f" with method {job.spec.method} and rollout servers beside it")
                        + f", queue {job.metadata.labels['kueue.x-k8s.io/queue-name']!r}"),
)
"""The one rule over the whole job (its labels): a CRD's CEL sees no `metadata.labels`, so
its CEL is over `object` and the chart's ValidatingAdmissionPolicy `<release>-jobs` carries
it (charts/rlhf-operator/templates/admission-policy.yaml; a unit test holds them equal);
`PodSettings.from_job` checks it in Python (the operator fails such a job, InvalidSpec;
`rlhfctl render` and `submit` exit 2)."""

JOB_RULES: tuple[Rule, ...] = (QUEUE_LABEL_BACKEND,)
"""Rules over the whole RLHFJob (check and detail take the job, CEL is over `object`)."""


class RuleViolations(ValueError):
    """One or more rules failed; `violations` holds (field path under spec, message)."""

    def __init__(self, violations: list[tuple[str, str]]):
        self.violations = violations
        super().__init__("; ".join(f"spec.{p}: {m}" for p, m in violations))


def violations(spec: Any) -> list[tuple[str, str]]:
    """(field path under spec, message with the values involved) of every rule `spec` breaks."""
    out = []
    for rule in RULES:
        if not rule.check(spec):
            detail = rule.detail(spec)
            out.append((rule.field_path, rule.message + (f" ({detail})" if detail else "")))
    return out


def check_spec(spec: Any) -> None:
    found = violations(spec)
    if found:
        raise RuleViolations(found)
