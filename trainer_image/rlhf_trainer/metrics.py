"""Per-step metrics: `metrics.jsonl` in the output directory and Prometheus gauges.

Keys (one JSON object per step, written by rank 0): see `STEP_GAUGES` below; the ones a
step does not produce (`kl` without a reference model, `value_loss` without a critic,
`mfu` and `peak_gpu_memory_bytes` without a GPU) are null or absent.

Prometheus: every gauge is declared up front, on the writer's own registry, with a stable
name `rlhf_<key>` (the alerts and the Grafana dashboards of the Helm chart query these
names; a test checks that each name they use is declared here). A gauge holds NaN until a
step sets it, and again when a step reports null. `rlhf_last_step_timestamp_seconds` is
the Unix time of the last `write` (the "no training step for N minutes" alert). Served on
rank 0 when RLHF_METRICS_PORT is set (the operator sets 9400 in trainer pods).
A row key that is not declared still goes to `metrics.jsonl`, and is logged once as not
exported: add it to `STEP_GAUGES` to export it.

Helpers for the row's newer keys (the run loop calls them once per step on rank 0):
`train_mfu` + `peak_flops` (mfu), `peak_gpu_memory_bytes`, `logprob_mismatch`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from rlhf_contract.pod import ENV_METRICS_PORT

log = logging.getLogger(__name__)

PREFIX = "rlhf_"
LAST_STEP_TIMESTAMP = "rlhf_last_step_timestamp_seconds"
EVAL_GAUGE = "rlhf_eval"
"""Labelled by dataset and metric: the `eval/<dataset>/<metric>` keys of a row."""

STEP_GAUGES: dict[str, str] = {
    "step": "Last completed RL step.",
    "policy_version": "Weight version the rollout servers hold (incremented by every weight sync).",
    # rollout (rank 0's orchestrator)
    "reward_mean": "Mean reward of the step's samples.",
    "score_mean": "Mean score (the logged task metric) of the step's samples.",
    "response_length_mean": "Mean response length in tokens.",
    "truncated_fraction": "Fraction of responses cut at rollout.maxTokens.",
    "dropped_group_fraction": "Fraction of sampled groups dropped by dynamic sampling (all rewards equal).",
    "dropped_prompts": "Prompts the data source skipped so far (longer than data.maxPromptLength, or empty).",
    "skipped_rows": "Malformed dataset rows skipped (unreadable, or a missing or mistyped column; RL and offline).",
    "logprob_mismatch": "Mean |trainer log-prob - rollout engine log-prob| per response token.",
    "staleness_mean": "Policy versions the step's samples lag behind the trainer (rollout.maxStaleness >= 1).",
    "staleness_max": "Largest lag of a sample of the step, in policy versions.",
    "rm_score_mean": "Mean reward-model score of the step's samples (reward.model; weighted into the reward).",
    "rm_score_std": "Standard deviation of the reward-model scores of the step's samples.",
    # train step
    "loss": "Policy loss.",
    "clip_fraction": "Fraction of tokens whose PPO ratio was clipped.",
    "approx_kl": "Approximate KL(old policy || policy) per token.",
    "entropy": "Mean per-token entropy of the policy.",
    "kl": "Mean per-token KL(policy || reference) (NaN without a reference model).",
    "grad_norm": "Policy gradient norm before clipping.",
    "skipped_steps": "Optimizer steps skipped in this RL step (non-finite gradients).",
    "advantage_mean": "Mean advantage over response tokens.",
    "advantage_std": "Standard deviation of the advantages over response tokens.",
    "padding_fraction": "Padding tokens / token slots of the packed micro-batches.",
    "value_loss": "Critic loss (PPO with a critic only).",
    "critic_grad_norm": "Critic gradient norm before clipping (PPO with a critic only).",
    "explained_variance": "Explained variance of the returns by the critic's values (PPO only).",
    "learning_rate": "Policy learning rate at the step.",
    # offline methods (sft, rm, dpo); the same on the held-out examples are rlhf_eval{dataset="held_out"}
    "accuracy": "RM and DPO: fraction of pairs whose chosen response scores above the rejected one.",
    "reward_margin": "RM and DPO: mean chosen minus rejected reward (RM score; DPO beta x log-ratio).",
    "chosen_reward": "RM and DPO: mean reward of the chosen responses.",
    "rejected_reward": "RM and DPO: mean reward of the rejected responses.",
    "chosen_logratio": "DPO: mean log pi(chosen) - log pi_ref(chosen).",
    "rejected_logratio": "DPO: mean log pi(rejected) - log pi_ref(rejected).",
    "num_examples": "Offline methods: examples (SFT sequences or preference pairs) in the step.",
    "dropped_examples": "Offline methods: examples dropped so far for not fitting the micro-batch budget.",
    # time and throughput
    "step_seconds": "Wall time of the RL step.",
    "rollout_seconds": "Wall time of the rollout phase (generation and rewards).",
    "train_seconds": "Wall time of the train phase (log-probs, advantages, updates).",
    "weight_sync_seconds": "Wall time of the weight sync to the rollout servers.",
    "tokens_per_second": "Prompt + response tokens of the step per second of step time.",
    "mfu": "Model FLOPs utilization of the train phase (fraction of the GPUs' peak; GPU only).",
    "peak_gpu_memory_bytes": "Peak GPU memory allocated by a trainer process during the step (GPU only).",
}


def gauge_names() -> set[str]:
    """Every Prometheus name a trainer exports (what rules and dashboards may query)."""
    return {PREFIX + key for key in STEP_GAUGES} | {LAST_STEP_TIMESTAMP, EVAL_GAUGE}


class MetricsWriter:
    """Appends each step's row to `metrics.jsonl` and sets the declared gauges.

    `port`: serve `/metrics` there (default: RLHF_METRICS_PORT; 0 or unset: no endpoint).
    """

    def __init__(self, output_dir: str | Path, port: int | None = None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if port is None:
            port = int(os.environ.get(ENV_METRICS_PORT) or 0)
        self.registry = None
        self._gauges: dict[str, Any] = {}
        self._unexported: set[str] = set()
        if port:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server

            self.registry = CollectorRegistry(auto_describe=True)
            for key, help_text in STEP_GAUGES.items():
                self._gauges[key] = Gauge(PREFIX + key, help_text, registry=self.registry)
                self._gauges[key].set(math.nan)
            self._last_step = Gauge(LAST_STEP_TIMESTAMP, "Unix time at which the last RL step was recorded.",
                                    registry=self.registry)
            self._eval = Gauge(EVAL_GAUGE, "Held-out scores of spec.evaluation (RL datasets: greedy_score, "
                               "mean_score, pass_at_k; offline methods' held_out: loss, accuracy, ...).",
                               ["dataset", "metric"], registry=self.registry)
            self._last_step.set(math.nan)
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
            if key.startswith("eval/") and isinstance(value, (int, float)):  # eval/<dataset>/<metric>
                _, dataset, metric = key.split("/", 2)
                self._eval.labels(dataset, "pass_at_k" if metric.startswith("pass@") else metric).set(float(value))
                continue
            gauge = self._gauges.get(key)
            if gauge is None:
                if isinstance(value, (int, float)) and key not in self._unexported:
                    self._unexported.add(key)
                    log.warning("metric %r is not declared in rlhf_trainer.metrics.STEP_GAUGES: written to "
                                "metrics.jsonl only, not exported to Prometheus", key)
                continue
            if value is None:
                gauge.set(math.nan)
            elif isinstance(value, (int, float)):
                gauge.set(float(value))
        self._last_step.set(time.time())


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
