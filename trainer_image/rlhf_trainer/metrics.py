"""Per-step metrics: `metrics.jsonl` in the output directory, Prometheus, and the trackers.

Keys (one JSON object per step, written by rank 0): see `STEP_KEYS` below; the ones a step
does not produce (`kl` without a reference model, `value_loss` without a critic, `mfu` and
`peak_gpu_memory_bytes` without a GPU) are null or absent. `reward/<name>_mean` is the mean
of each reward component (`reward.components`), `reward/<function>/<metric>` what a python
reward function logged with TRL's `log_metric` (the step's mean; metrics.jsonl and trackers
only), `eval/<dataset>/<metric>` an evaluation.

Prometheus names follow its conventions: base units (`_seconds`, `_bytes`), counters end in
`_total` (counts so far: dropped prompts, skipped rows; sums over steps: tokens, examples,
skipped optimizer steps, steps), ratios in `_ratio`, one family per meaning with labels for
the rest (`rlhf_step_duration_seconds{phase}`, `rlhf_reward_component_mean{component}`,
`rlhf_eval_pass_at_k_ratio{dataset,k}`). Every family is declared up front on the writer's
own registry (the Helm chart's alerts and dashboards query these names; a test checks that
each name they use is declared here). A gauge holds NaN until a step sets it, and again
when a step reports null. `rlhf_last_step_timestamp_seconds` is the Unix time of the last
`write` (the "no training step for N minutes" alert). Served when RLHF_METRICS_PORT is set
(the operator sets 9400 in trainer pods). A row key that is not declared still goes to
`metrics.jsonl` and the trackers, and is logged once as not exported.

Helpers for the row's newer keys (the run loop calls them once per step on rank 0):
`train_mfu` + `peak_flops` (mfu), `peak_gpu_memory_bytes`, `logprob_mismatch`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_contract.pod import ENV_METRICS_PORT

log = logging.getLogger(__name__)

LAST_STEP_TIMESTAMP = "rlhf_last_step_timestamp_seconds"
STEPS_TOTAL = "rlhf_steps_total"
COMPONENT_FAMILY = "rlhf_reward_component_mean"
JUDGE_FAMILIES = {"judge_answers": "rlhf_judge_answers_total", "parse_failures": "rlhf_judge_parse_failures_total",
                  "judge_tokens": "rlhf_judge_tokens_total"}
"""`reward/<name>_<counter>` of a judge (the step's amount) -> its counter (label `component`:
the function's name); the alert RLHFJudgeAnswersUnparsable divides the first two."""
PASS_AT_K_FAMILY = "rlhf_eval_pass_at_k_ratio"


@dataclass(frozen=True)
class Family:
    """One Prometheus metric family. kind `gauge`: the row's value; `counter`: the row's
    value is a count so far (the counter follows it); `counter_sum`: the row's value is this
    step's amount (the counter adds it)."""

    help: str
    kind: Literal["gauge", "counter", "counter_sum"] = "gauge"
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Key:
    """Where a row key goes: a family (by Prometheus name) and its label values."""

    family: str
    labels: dict[str, str] = field(default_factory=dict)


def _g(help_text: str) -> Family:
    return Family(help_text)


FAMILIES: dict[str, Family] = {
    "rlhf_step": _g("Last completed step."),
    "rlhf_policy_version": _g("Weight version the rollout servers hold (incremented by every weight sync)."),
    # rollout (rank 0's orchestrator)
    "rlhf_reward_mean": _g("Mean reward (the trained total) of the step's samples."),
    "rlhf_reward_std": _g("Standard deviation of the rewards of the step's samples."),
    "rlhf_reward_min": _g("Smallest reward of the step's samples."),
    "rlhf_reward_max": _g("Largest reward of the step's samples."),
    COMPONENT_FAMILY: Family("Mean of each reward component before weighting (reward.components).", "gauge",
                             ("component",)),
    JUDGE_FAMILIES["judge_answers"]: Family("Answers the judge gave (reward.type judge).", "counter_sum",
                                            ("component",)),
    JUDGE_FAMILIES["parse_failures"]: Family("Judge answers not in the judge's strict format (reward.type judge; "
                                             "each scored the judge's lowest reward).", "counter_sum", ("component",)),
    JUDGE_FAMILIES["judge_tokens"]: Family("Tokens (prompt + answer) the judge requests used (reward.type judge).",
                                           "counter_sum", ("component",)),
    "rlhf_score_mean": _g("Mean score (the logged task metric) of the step's samples."),
    "rlhf_response_length_mean": _g("Mean response length in tokens."),
    "rlhf_response_length_min": _g("Shortest response of the step in tokens."),
    "rlhf_response_length_max": _g("Longest response of the step in tokens."),
    "rlhf_truncated_ratio": _g("Fraction of responses cut at rollout.maxTokens (clipped responses); with "
                               "rollout.tools also episodes ended by tools.maxTurns."),
    "rlhf_tool_calls_mean": _g("rollout.tools: tool calls per episode."),
    "rlhf_tool_errors": _g("rollout.tools: tool calls of the step that failed (the model's malformed calls and "
                           "failing tools)."),
    "rlhf_turns_mean": _g("rollout.tools: model turns per episode."),
    "rlhf_tool_failed_ratio": _g("rollout.tools: fraction of episodes ended by a failing tool (timeout, raised, "
                                 "output past the cap, crashed)."),
    "rlhf_agent_failed_ratio": _g("rollout.agent: fraction of episodes whose agent failed (exited non-zero or "
                                  "without a call, or timed out)."),
    "rlhf_zero_std_group_ratio": _g("Fraction of sampled groups whose rewards are all equal (no GRPO signal)."),
    "rlhf_dropped_group_ratio": _g("Fraction of sampled groups dropped by dynamic sampling (all rewards equal)."),
    "rlhf_dropped_prompts_total": Family("Prompts the data source skipped (longer than data.maxPromptLength, "
                                         "or empty).", "counter"),
    "rlhf_rollout_server_replacements_total": Family("Rollout servers lost and re-joined with the current weights in "
                                                     "this attempt (rollout.maxServerReplacements).", "counter"),
    "rlhf_skipped_rows_total": Family("Malformed dataset rows skipped (unreadable, or a missing or mistyped "
                                      "column; RL and offline).", "counter"),
    "rlhf_trainable_parameters": _g("Parameters the optimizer updates (with model.lora: the adapters only)."),
    "rlhf_logprob_mismatch": _g("Mean |trainer log-prob - rollout engine log-prob| per response token."),
    "rlhf_rollout_correction_masked_ratio": _g("algorithm.rolloutCorrection: response tokens of the step masked "
                                               "out of the loss (their importance ratio outside the band)."),
    "rlhf_rollout_correction_weight_mean": _g("algorithm.rolloutCorrection: mean importance weight of the "
                                              "tokens kept."),
    "rlhf_staleness_mean": _g("Policy versions the step's response tokens lag behind the trainer, per token "
                              "(rollout.maxStaleness >= 1)."),
    "rlhf_staleness_max": _g("Largest lag of a response token of the step, in policy versions."),
    "rlhf_stale_token_ratio": _g("Response tokens of the step taken out of the loss for lagging more than "
                                 "rollout.maxStaleness versions."),
    "rlhf_mixed_version_ratio": _g("rollout.inFlightUpdates: responses of the step sampled by more than one policy "
                                   "version (a weight update arrived while they were generated)."),
    "rlhf_rm_score_mean": _g("Mean reward-model score of the step's samples (reward.model; weighted into the reward)."),
    "rlhf_rm_score_std": _g("Standard deviation of the reward-model scores of the step's samples."),
    "rlhf_distill_reverse_kl": _g("method distill: mean per-token reverse-KL estimate log p_student - log p_teacher "
                                  "of the sampled tokens."),
    "rlhf_distill_teacher_logprob": _g("method distill: mean teacher log-prob of the sampled tokens."),
    "rlhf_distill_student_logprob": _g("method distill: mean student (policy) log-prob of the sampled tokens."),
    # train step
    "rlhf_loss": _g("Training loss of the step (policy loss for RL)."),
    "rlhf_clip_ratio": _g("Fraction of tokens whose PPO ratio was clipped."),
    "rlhf_approx_kl": _g("Approximate KL(old policy || policy) per token."),
    "rlhf_entropy": _g("Mean per-token entropy of the policy."),
    "rlhf_kl": _g("Mean per-token KL(policy || reference) (NaN without a reference model)."),
    "rlhf_grad_norm": _g("Gradient norm before clipping."),
    "rlhf_skipped_optimizer_steps_total": Family("Optimizer steps skipped (non-finite gradients).", "counter_sum"),
    "rlhf_advantage_mean": _g("Mean advantage over response tokens."),
    "rlhf_advantage_std": _g("Standard deviation of the advantages over response tokens."),
    "rlhf_padding_ratio": _g("Padding tokens / token slots of the packed micro-batches."),
    "rlhf_value_loss": _g("Critic loss (PPO with a critic only)."),
    "rlhf_critic_grad_norm": _g("Critic gradient norm before clipping (PPO with a critic only)."),
    "rlhf_explained_variance": _g("Explained variance of the returns by the critic's values (PPO only)."),
    "rlhf_learning_rate": _g("Learning rate at the step."),
    # offline methods (sft, rm, dpo)
    "rlhf_accuracy_ratio": _g("RM and DPO: fraction of pairs whose chosen response scores above the rejected one."),
    "rlhf_reward_margin": _g("RM and DPO: mean chosen minus rejected reward (RM score; DPO beta x log-ratio)."),
    "rlhf_chosen_reward": _g("RM and DPO: mean reward of the chosen responses."),
    "rlhf_rejected_reward": _g("RM and DPO: mean reward of the rejected responses."),
    "rlhf_chosen_logratio": _g("DPO: mean log pi(chosen) - log pi_ref(chosen)."),
    "rlhf_rejected_logratio": _g("DPO: mean log pi(rejected) - log pi_ref(rejected)."),
    "rlhf_examples_total": Family("Offline methods: examples (SFT sequences or preference pairs) trained on.",
                                  "counter_sum"),
    "rlhf_dropped_examples_total": Family("Offline methods: examples dropped for not fitting the micro-batch "
                                          "budget.", "counter"),
    # time and throughput
    "rlhf_step_duration_seconds": Family("Wall time of the last step (phase step) and of its phases: rollout "
                                         "(generation and rewards), train, weight_sync.", "gauge", ("phase",)),
    STEPS_TOTAL: Family("Steps completed by this process.", "counter_sum"),
    "rlhf_tokens_total": Family("Prompt + response tokens trained on (rate() is the throughput).", "counter_sum"),
    "rlhf_mfu_ratio": _g("Model FLOPs utilization of the train phase (fraction of the GPUs' peak; GPU only)."),
    "rlhf_peak_gpu_memory_bytes": _g("Peak GPU memory allocated by a trainer process during the step (GPU only)."),
    LAST_STEP_TIMESTAMP: _g("Unix time at which the last step was recorded."),
    PASS_AT_K_FAMILY: Family("spec.evaluation: fraction of prompts with a response scoring at least 1 among k.",
                             "gauge", ("dataset", "k")),
}

_RENAMED = {"truncated_fraction": "rlhf_truncated_ratio", "tool_failed_fraction": "rlhf_tool_failed_ratio",
            "agent_failed_fraction": "rlhf_agent_failed_ratio", "zero_std_group_fraction": "rlhf_zero_std_group_ratio",
            "dropped_group_fraction": "rlhf_dropped_group_ratio", "clip_fraction": "rlhf_clip_ratio",
            "padding_fraction": "rlhf_padding_ratio", "accuracy": "rlhf_accuracy_ratio", "mfu": "rlhf_mfu_ratio",
            "rollout_correction_masked_fraction": "rlhf_rollout_correction_masked_ratio",
            "stale_token_fraction": "rlhf_stale_token_ratio", "mixed_version_fraction": "rlhf_mixed_version_ratio",
            "dropped_prompts": "rlhf_dropped_prompts_total",
            "rollout_server_replacements": "rlhf_rollout_server_replacements_total", "skipped_rows": "rlhf_skipped_rows_total",
            "skipped_steps": "rlhf_skipped_optimizer_steps_total", "num_examples": "rlhf_examples_total",
            "dropped_examples": "rlhf_dropped_examples_total", "num_tokens": "rlhf_tokens_total"}
STEP_KEYS: dict[str, Key] = {
    **{name.removeprefix("rlhf_"): Key(name) for name, f in FAMILIES.items() if not f.labels
       and not name.endswith(("_total", "_ratio")) and name != LAST_STEP_TIMESTAMP},
    **{key: Key(name) for key, name in _RENAMED.items()},
    **{f"{phase}_seconds": Key("rlhf_step_duration_seconds", {"phase": phase})
       for phase in ("step", "rollout", "train", "weight_sync")},
}
"""Every numeric key of a row that Prometheus exports, and where it goes."""
JSONL_ONLY = frozenset({"tokens_per_second"})
"""Row keys kept out of Prometheus on purpose (a rate: Prometheus computes it from a counter)."""

EVAL_METRICS = ("greedy_score", "mean_score", "loss", "accuracy", "reward_margin", "chosen_reward",
                "rejected_reward", "chosen_logratio", "rejected_logratio")
"""`eval/<dataset>/<metric>` keys other than pass@k, each exported as `rlhf_eval_<name>{dataset}`."""


def eval_family(metric: str) -> str:
    return "rlhf_eval_" + STEP_KEYS[metric].family.removeprefix("rlhf_") if metric in STEP_KEYS \
        else "rlhf_eval_" + metric


for _metric in EVAL_METRICS:
    FAMILIES[eval_family(_metric)] = Family(f"spec.evaluation: {_metric} of each held-out set.", "gauge",
                                            ("dataset",))


def exported_names() -> set[str]:
    """Every Prometheus name a trainer exports (what rules and dashboards may query)."""
    return set(FAMILIES)


_COMPONENT = re.compile(r"^reward/([^/]+)_mean$")
_JUDGE = re.compile(r"^reward/([^/]+)_(" + "|".join(JUDGE_FAMILIES) + r")$")
_LOGGED = re.compile(r"^reward/[^/]+/")
"""`reward/<function>/<metric>`: what a python reward logged (TRL's log_metric): metrics.jsonl
and the trackers only (a user's names are not a Prometheus family)."""
_PASS_AT = re.compile(r"^pass@(\d+)$")


def route(key: str) -> tuple[str, dict[str, str]] | None:
    """(family, labels) of a row key, or None if Prometheus does not export it."""
    if key in STEP_KEYS:
        return STEP_KEYS[key].family, STEP_KEYS[key].labels
    if (m := _JUDGE.match(key)) is not None:
        return JUDGE_FAMILIES[m.group(2)], {"component": m.group(1)}
    if (m := _COMPONENT.match(key)) is not None:
        return COMPONENT_FAMILY, {"component": m.group(1)}
    if key.startswith("eval/") and key.count("/") >= 2:
        _, dataset, metric = key.split("/", 2)
        if (m := _PASS_AT.match(metric)) is not None:
            return PASS_AT_K_FAMILY, {"dataset": dataset, "k": m.group(1)}
        if metric in EVAL_METRICS:
            return eval_family(metric), {"dataset": dataset}
    return None


class MetricsWriter:
    """Appends each step's row to `metrics.jsonl` and sets the declared families.

    `port`: serve `/metrics` there (default: RLHF_METRICS_PORT; 0 or unset: no endpoint).
    """

    def __init__(self, output_dir: str | Path, port: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if port is None:
            port = int(os.environ.get(ENV_METRICS_PORT) or 0)
        self.registry = None
        self._metrics: dict[str, Any] = {}
        self._counted: dict[tuple[str, tuple[str, ...]], float] = {}
        self._unexported: set[str] = set()
        if port:
            from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server

            disable_created_metrics()  # no `_created` series beside each counter
            self.registry = CollectorRegistry(auto_describe=True)
            for name, family in FAMILIES.items():
                self._metrics[name] = _declare(name, family, self.registry)
            start_http_server(port, registry=self.registry)

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run rewrites them)."""
        if not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.registry is None:
            return
        for key, value in row.items():
            where = route(key)
            if where is None:
                if isinstance(value, (int, float)) and key not in self._unexported | JSONL_ONLY and not _LOGGED.match(key):
                    self._unexported.add(key)
                    log.warning("metric %r is not declared in rlhf_trainer.metrics.STEP_KEYS: written to "
                                "metrics.jsonl only, not exported to Prometheus", key)
                continue
            if value is None or isinstance(value, (int, float)):
                self._set(*where, value)
        self._metrics[STEPS_TOTAL].inc()
        self._metrics[LAST_STEP_TIMESTAMP].set(time.time())

    def _set(self, name: str, labels: dict[str, str], value: float | None) -> None:
        family, metric = FAMILIES[name], self._metrics[name]
        if labels:
            metric = metric.labels(**labels)
        if family.kind == "gauge":
            metric.set(math.nan if value is None else float(value))
        elif value is not None and math.isfinite(value):
            if family.kind == "counter_sum":
                metric.inc(max(0.0, float(value)))
            else:  # a count so far: the counter follows it (from 0 in a new process)
                seen = (name, tuple(labels.values()))
                metric.inc(max(0.0, float(value) - self._counted.get(seen, 0.0)))
                self._counted[seen] = max(float(value), self._counted.get(seen, 0.0))


def _declare(name: str, family: Family, registry: Any) -> Any:
    from prometheus_client import Counter, Gauge

    if family.kind == "gauge":
        gauge = Gauge(name, family.help, list(family.labels), registry=registry)
        if not family.labels:
            gauge.set(math.nan)
        return gauge
    return Counter(name.removesuffix("_total"), family.help, list(family.labels), registry=registry)


# ---- values the run loop puts into the row (the new dashboard keys) ---------------------

# Dense peak throughput per device (FLOP/s) by CUDA device-name substring, for MFU.
# bf16 / fp16 tensor-core peaks without sparsity; fp32 uses the TF32 tensor-core peak.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 494e12},
    "H100": {"bf16": 989e12, "fp32": 494e12},  # SXM; PCIe is lower (756e12)
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "L40S": {"bf16": 362e12, "fp32": 183e12},
}


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Peak FLOP/s of one device of this name (torch.cuda.get_device_name()); None if unknown."""
    if "PCIe" in device_name and "H100" in device_name:
        return {"bf16": 756e12, "fp32": 378e12}[dtype]
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name:
            return peaks[dtype]
    return None


def train_mfu(*, num_params: int, tokens: float, train_seconds: float, world_size: int,
              device_peak_flops: float | None, passes: float = 3.0) -> float | None:
    """Model FLOPs utilization of the train phase: `passes` x 2 x params FLOPs per token
    (forward 2N, backward 4N: passes = 3; add 1 per extra forward pass, e.g. old and
    reference log-probs), over the step's train time on `world_size` devices. None when
    the device's peak is unknown (CPU)."""
    if not device_peak_flops or train_seconds <= 0 or world_size <= 0:
        return None
    return passes * 2.0 * num_params * tokens / (train_seconds * world_size * device_peak_flops)


def peak_gpu_memory_bytes(reset: bool = True) -> int | None:
    """Peak memory allocated by this process on its CUDA device since the last reset (None
    without CUDA); resets the peak so the next step starts afresh."""
    import torch

    if not torch.cuda.is_available():
        return None
    peak = int(torch.cuda.max_memory_allocated())
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return peak


def logprob_mismatch(logprobs, rollout_logprobs, mask) -> float:
    """Mean |trainer log-prob - rollout engine log-prob| over response tokens ([B, T]
    tensors, mask 1 on response tokens): how far the two engines disagree on the same
    tokens with the same weights (dtype, kernels, or stale weights after a bad sync)."""
    diff = (logprobs.detach().float() - rollout_logprobs.detach().float()).abs() * mask
    return float(diff.sum() / mask.sum().clamp(min=1))
