"""The run loop, on every trainer process: build, resume, then for each step

  1. rollout   rank 0's orchestrator collects a `RolloutBatch` (or, with
               `rollout.maxStaleness` >= 1, takes the one generated ahead while the previous
               steps trained: orchestrator/prefetch.py); it is broadcast to all ranks
  2. train     `TrainStep.prepare` (old / reference log-probs, values, advantages) and the
               optimizer steps (train/step.py)
  3. sync      every rank gathers full tensors, rank 0 streams them to the rollout servers
               (skipped when every optimizer step of the step was skipped: the weights did
               not change)
  4. record    metrics (`metrics.jsonl`, Prometheus), checkpoint every `schedule.saveEvery`

The loop owns the state that a checkpoint holds (`state_dict`): step, policy version and
the orchestrator's data position.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf_contract.trainer_config import TrainerConfig

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final
from .distributed import DistInfo, broadcast_object
from .metrics import MetricsWriter, logprob_mismatch, peak_flops, peak_gpu_memory_bytes, train_mfu
from .models.loading import build_models
from .train.lr_schedule import lr_factor
from .train.step import TrainStep

log = logging.getLogger("rlhf_trainer")

DEFAULT_STALE_TIS_CAP = 2.0
"""`algorithm.tisCap` used with `rollout.maxStaleness` >= 1 when none is set."""


@contextmanager
def span(timings: dict[str, float], name: str):
    """Time a phase of the step into `timings[name]` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


class RunLoop:
    def __init__(self, config: TrainerConfig, info: DistInfo, *, endpoints: list[str], weight_sync_addr: str,
                 output_dir: str):
        from transformers import AutoTokenizer

        self.config, self.info = config, info
        self.output_dir = Path(output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        torch.manual_seed(config.schedule.seed)
        self.models, self.layout = build_models(config, info, self.tokenizer.pad_token_id)
        o = config.optim
        algorithm = config.algorithm
        self.max_staleness = config.sampling.max_staleness
        if self.max_staleness and algorithm.tis_cap is None:  # stale samples: correct toward the trainer's policy
            algorithm = algorithm.model_copy(update={"tis_cap": DEFAULT_STALE_TIS_CAP})
        self.train_step = TrainStep(algorithm, self.models, self.layout,
                                    max_tokens_per_micro_batch=o.max_tokens_per_micro_batch,
                                    max_grad_norm=o.max_grad_norm, temperature=config.sampling.temperature,
                                    device=info.device,
                                    reward_model_weight=config.reward.model.weight if config.reward.model else 1.0)
        self.step = 0
        self.policy_version = 0
        self.served_version = 0  # what the rollout servers hold (advanced after each completed sync)
        self.prefetcher = None
        self._data_position: dict | None = None  # after the last batch taken (maxStaleness >= 1)
        self.orchestrator = self.sender = self.metrics = self.progress = None
        self._last_row: dict[str, Any] = {}
        self.num_params = sum(p.numel() for p in self.models.policy.parameters())  # a DTensor's numel is global
        if info.is_main:
            from .progress import ProgressReporter
            from .orchestrator.orchestrator import Orchestrator
            from .weight_sync import WeightSyncSender

            self.orchestrator = Orchestrator.build(config, self.tokenizer, endpoints, self.output_dir)
            self.evaluator = None
            if config.evaluation is not None:
                from .evaluation import Evaluator

                self.evaluator = Evaluator(config, self.tokenizer, self.orchestrator.client,
                                           self.orchestrator.sampler.scorer)
            host, port = weight_sync_addr.rsplit(":", 1)
            self.sender = WeightSyncSender(endpoints, host, int(port))
            self.metrics = MetricsWriter(self.output_dir)
            self.progress = ProgressReporter.from_config(config)  # no-op outside a cluster

    @property
    def parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        m = self.models
        parts = {"policy": (m.policy, m.optimizer)}
        if m.critic is not None:
            parts["critic"] = (m.critic, m.critic_optimizer)
        return parts

    def _lr_factor(self, k: int) -> float:
        o, n = self.config.optim, self.config.algorithm.num_mini_batches
        return lr_factor((self.step - 1) * n + k, total=self.config.schedule.total_steps * n, warmup=o.warmup_steps,
                         kind=o.lr_scheduler, min_ratio=o.min_learning_rate_ratio)

    # ---- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        orchestrator = None
        if self.orchestrator is not None:  # batches generated ahead are regenerated after a resume
            orchestrator = ({"data": self._data_position} if self._data_position is not None
                            else self.orchestrator.state_dict())
        return {"policy_version": self.policy_version, "orchestrator": orchestrator}

    def resume_if_possible(self) -> None:
        path = latest_checkpoint(self.output_dir)
        if path is None:
            return
        state = load_checkpoint(path, self.parts)
        self.step = int(state["step"])
        self.policy_version = int(state.get("policy_version", self.step))
        if self.orchestrator is not None:
            self.orchestrator.load_state_dict(state["orchestrator"])
            self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    def save(self) -> None:
        state = broadcast_object(self.state_dict())
        save_checkpoint(self.output_dir, self.step, self.parts, state, keep=self.config.output.keep_checkpoints)

    # ---- one step ---------------------------------------------------------------------

    def sync_weights(self) -> float:
        """Every rank gathers full tensors; rank 0 sends them (every parameter, HF names)."""
        start = time.perf_counter()
        params = list(self.models.policy.named_parameters())

        def full_tensors():
            for _, p in params:
                yield (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

        if self.info.is_main:
            metadata = [(name, list(p.shape), p.dtype) for name, p in params]
            self.sender.send(metadata, full_tensors(), weight_version=str(self.policy_version))
        else:
            for _ in full_tensors():
                pass
        dist.barrier()
        return time.perf_counter() - start

    def _next_batch(self):
        """Rank 0: this step's rollouts, generated now (synchronous) or ahead (maxStaleness)."""
        if self.prefetcher is None:
            return self.orchestrator.collect(self.step)
        batch = self.prefetcher.take(self.step)
        batch.extra["staleness"] = self.served_version - batch.extra["policy_version"]
        if batch.extra["staleness"] > self.max_staleness:  # the producer's gate makes this impossible
            raise RuntimeError(f"step {self.step}: a batch {batch.extra['staleness']} versions old exceeds "
                               f"rollout.maxStaleness={self.max_staleness}")
        self._data_position = batch.extra["data_position"]
        return batch

    def run_step(self) -> dict[str, Any] | None:
        timings: dict[str, float] = {}
        with span(timings, "step_seconds"):
            with span(timings, "rollout_seconds"):  # with maxStaleness >= 1: waiting for a prefetched batch
                batch = self._next_batch() if self.info.is_main else None
                batch = broadcast_object(batch)
            with span(timings, "train_seconds"):
                tensors = self.train_step.prepare(batch)
                train = self.train_step(batch, tensors, lr_factor=self._lr_factor)
            if train["skipped_steps"] < self.config.algorithm.num_mini_batches:
                self.policy_version += 1
                timings["weight_sync_seconds"] = self.sync_weights()
                self.served_version = self.policy_version
            else:
                log.warning("step %d: every optimizer step had a non-finite gradient norm; weights unchanged, "
                            "no weight sync", self.step)
                timings["weight_sync_seconds"] = 0.0
        if not self.info.is_main:
            return None
        stats = vars(batch.stats).copy()
        num_tokens = stats.pop("num_tokens")
        lr = self.config.optim.learning_rate * self._lr_factor(self.config.algorithm.num_mini_batches - 1)
        extra = {}
        if tensors.old_logprobs is not None:  # same weights, two engines: how far they disagree
            extra["logprob_mismatch"] = logprob_mismatch(tensors.old_logprobs, tensors.rollout_logprobs, tensors.mask)
        dev = self.info.device
        if dev.type == "cuda":
            passes = 3.0 + (tensors.old_logprobs is not None) + (tensors.ref_logprobs is not None)
            extra["mfu"] = train_mfu(num_params=self.num_params, tokens=num_tokens,
                                     train_seconds=timings["train_seconds"], world_size=self.info.world_size,
                                     device_peak_flops=peak_flops(torch.cuda.get_device_name(dev)), passes=passes)
            extra["peak_gpu_memory_bytes"] = peak_gpu_memory_bytes()
        extra.update(self.train_step.reward_model_metrics)
        if "staleness" in batch.extra:
            extra["staleness_mean"] = extra["staleness_max"] = batch.extra["staleness"]
        return {"step": self.step, **stats, **train, **extra, "learning_rate": lr, **timings,
                "tokens_per_second": num_tokens / timings["step_seconds"], "policy_version": self.policy_version}

    def run(self) -> None:
        s = self.config.schedule
        if self.info.is_main:
            from .rollout.client import check_rollout_servers

            # as long as the servers' startup probe allows; exit 2 naming rollout.image without weight transfer
            check_rollout_servers(self.orchestrator.client.endpoints,
                                  startup_timeout_s=self.config.rollout_startup_timeout_seconds)
            self.sender.init()
        self.sync_weights()  # servers start from exactly the trainer's weights (also after a resume)
        self.served_version = self.policy_version
        if self.max_staleness and self.info.is_main:
            from .orchestrator.prefetch import Prefetcher

            self.prefetcher = Prefetcher(self.orchestrator, max_staleness=self.max_staleness, first_step=self.step + 1,
                                         served_version=lambda: self.served_version)
        evaluator = getattr(self, "evaluator", None)
        before = evaluator.run(0) if evaluator is not None and self.step == 0 else {}
        try:
            while self.step < s.total_steps:
                self.step += 1
                row = self.run_step()
                if row is not None and evaluator is not None:
                    if self.step == 1:  # scored before the first step (replaced when step 1 is scored too)
                        row.update(before)
                    if evaluator.due(self.step):
                        row.update(evaluator.run(self.step))
                if s.save_every and self.step % s.save_every == 0:
                    self.save()
                if row is not None:
                    self.metrics.write(row)
                    self._last_row = row
                    self._report(row)
                    log.info("step %d/%d reward %.3f loss %.4f %.2fs", self.step, s.total_steps, row["reward_mean"],
                             row["loss"], row["step_seconds"])
            if s.save_every:
                self.save()
            save_final(self.output_dir, self.models.policy, self.tokenizer)
            if self.info.is_main:
                self._report(self._last_row)  # the final checkpoint
                log.info("rollout requests per endpoint: %s", json.dumps(self.orchestrator.client.requests_sent))
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()
            if self.orchestrator is not None:
                self.orchestrator.client.close()
            if self.progress is not None:
                self.progress.close()
            if self.sender is not None:
                self.sender.close()

    def _report(self, row: dict[str, Any]) -> None:
        """status.progress of the job (rank 0; rate-limited, never raises)."""
        newest = latest_checkpoint(self.output_dir)
        self.progress.report(self.step, reward_mean=row.get("reward_mean"), policy_version=self.policy_version,
                             last_checkpoint=str(newest) if newest is not None else None)
