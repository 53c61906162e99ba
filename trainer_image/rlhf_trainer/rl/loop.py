"""The RL run loop, on every trainer process (resume, save, evaluation, records and
clean-up: loop.py). For each step:

  1. rollout   rank 0's orchestrator collects a `RolloutBatch` (or, with
               `rollout.maxStaleness` >= 1, takes the one generated ahead while the previous
               steps trained: orchestrator/prefetch.py; with `rollout.inFlightUpdates`, the
               first groups to complete in a pool kept generating: orchestrator/partial.py);
               it is broadcast to all ranks
  2. train     `TrainStep.prepare` (old / reference log-probs, values, advantages) and the
               optimizer steps (rl/step.py)
  3. sync      every rank gathers full tensors, rank 0 streams them to the rollout servers
               (`WeightSync.push`; when the placement says so: a separate placement skips it
               when every optimizer step of the step was skipped, a colocated one never)
  4. record    the step's metrics row (rank 0)

Where the servers run is one object (rl/placement.py `Separate` / `Colocated`), asked at
each point where the placement matters: before and after the rollout, before a sync,
whether to sync, and around evaluation. The loop itself never branches on the placement.

A checkpoint holds, besides the models, the policy version and the orchestrator's data
position (after the last batch the trainer took; with partial rollouts also the prompts
handed out and not yet trained, which a resume generates again).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Any

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..checkpoint import Parts
from ..distributed import DistInfo, broadcast_object
from ..loop import LoopBase
from ..metrics import logprob_mismatch, peak_flops, peak_gpu_memory_bytes, train_mfu
from ..optim import schedule_factor
from ..orchestrator.types import RolloutBatch
from ..preemption import STOP, StepAbandoned
from .models import build_models
from .placement import WeightSync, placement_of
from .step import TrainStep

log = logging.getLogger("rlhf_trainer")


@contextmanager
def span(timings: dict[str, float], name: str):
    """Time a phase of the step into `timings[name]` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = time.perf_counter() - start


class RunLoop(LoopBase):
    def __init__(self, config: TrainerConfig, info: DistInfo, *, endpoints: list[str], weight_sync_addr: str,
                 output_dir: str):
        super().__init__(config, info, output_dir=output_dir)
        self.models, self.layout = build_models(config, info, self.tokenizer.pad_token_id)
        o = config.optim
        self.train_step = TrainStep(config.algorithm, self.models, self.layout,
                                    max_tokens_per_micro_batch=o.max_tokens_per_micro_batch,
                                    max_grad_norm=o.max_grad_norm, temperature=config.sampling.temperature,
                                    device=info.device,
                                    reward_model_weight=config.reward.model.weight if config.reward.model else 1.0,
                                    distillation=config.distillation)
        self.max_staleness = config.sampling.max_staleness
        self.policy_version = 0
        self.prefetcher = None
        self.data_position: dict | None = None  # after the last batch taken (maxStaleness >= 1)
        self.orchestrator = sender = None
        self.num_params = self.models.engine.total_parameters()
        self.train_seconds = 0.0  # the last step's update and sync: what finishing a step after SIGTERM costs
        self._before_step: dict[str, Any] | None = None
        if info.is_main:
            from ..orchestrator.orchestrator import Orchestrator
            from ..weight_sync import WeightSyncSender

            self.orchestrator = Orchestrator.build(config, self.tokenizer, endpoints, self.output_dir)
            host, port = weight_sync_addr.rsplit(":", 1)
            sender = WeightSyncSender(endpoints, host, int(port), timeout_s=config.rollout_weight_sync_timeout_seconds,
                                      pause_mode=config.sampling.weight_update_pause_mode)
        self.placement = placement_of(config, self.models.engines(), endpoints, info.is_main)
        self.weights = WeightSync(self.models.engine, sender, self.placement,
                                  replacements=config.rollout_max_server_replacements,
                                  client=self.orchestrator.sampler.client if self.orchestrator is not None else None)

    def parts(self) -> Parts:
        return self.models.parts()

    def lr_factor(self, k: int) -> float:
        """The learning-rate factor of this step's k-th optimizer step."""
        n = self.config.algorithm.num_mini_batches
        return schedule_factor(self.config.optim, (self.step - 1) * n + k, self.config.schedule.total_steps * n)

    # ---- state ------------------------------------------------------------------------

    def extra_state(self) -> dict[str, Any]:
        orchestrator = None
        if self.orchestrator is not None:  # batches generated ahead are regenerated after a resume
            orchestrator = ({"data": self.data_position} if self.data_position is not None
                            else self.orchestrator.state_dict())
        return {"policy_version": self.policy_version, "orchestrator": orchestrator}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.policy_version = int(state.get("policy_version", self.step))
        if self.orchestrator is not None:
            self.orchestrator.load_state_dict(state["orchestrator"])

    # ---- the run ----------------------------------------------------------------------

    def start(self) -> None:
        self.weights.start(self.orchestrator.check_servers() if self.info.is_main else None)  # one handshake
        self.sync_weights()  # servers start from exactly the trainer's weights (also after a resume)
        if self.max_staleness and self.info.is_main:
            from ..orchestrator.partial import PartialPrefetcher, supports_partial
            from ..orchestrator.prefetch import Prefetcher

            self.data_position = self.orchestrator.state_dict()["data"]  # before the producer hands anything out
            kind = PartialPrefetcher if supports_partial(self.orchestrator) else Prefetcher
            self.prefetcher = kind(self.orchestrator, max_staleness=self.max_staleness, first_step=self.step + 1,
                                   last_step=self.config.schedule.total_steps,
                                   served_version=lambda: self.weights.served_version)

    def evaluate(self, step: int) -> dict[str, Any]:
        has_datasets = self.config.evaluation is not None and bool(self.config.evaluation.datasets)
        return self.placement.evaluate(lambda: self.orchestrator.evaluate(step) if self.orchestrator is not None else {},
                                       self.sync_weights, has_datasets)

    def finish(self) -> None:
        if self.orchestrator is not None:
            log.info("rollout requests per endpoint: %s", json.dumps(self.orchestrator.requests_sent))

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.orchestrator is not None:
            self.orchestrator.close()
        self.weights.close()
        self.placement.close()

    def sync_weights(self) -> float:
        """Collective: the servers get the policy's weights (tagged with its version)."""
        return self.weights.push(self.policy_version)

    def _next_batch(self) -> RolloutBatch:
        """Rank 0: this step's rollouts, generated now (synchronous) or ahead (maxStaleness)."""
        if self.prefetcher is None:
            return self.orchestrator.collect(self.step)
        batch = self.prefetcher.take(self.step)
        batch.staleness = self.weights.served_version - batch.policy_version
        if batch.staleness > self.max_staleness and self.prefetcher.whole_batches:  # impossible: the producer's gate
            raise RuntimeError(f"step {self.step}: a batch {batch.staleness} versions old exceeds "
                               f"rollout.maxStaleness={self.max_staleness}")
        self.data_position = batch.data_position
        return batch

    def run_step(self) -> dict[str, Any] | None:
        timings: dict[str, float] = {}
        self._before_step = self.extra_state() if self.info.is_main else None
        with span(timings, "step_seconds"):
            with span(timings, "rollout_seconds"):  # with maxStaleness >= 1: waiting for a prefetched batch
                self.placement.before_rollout()
                batch = self._next_batch() if self.info.is_main else None
                batch = broadcast_object(batch)
                self.placement.after_rollout()
            stop = STOP.agree(self.train_seconds + self.save_seconds, self.info.device)
            if stop.abandon:  # nothing of this step has touched the models yet
                log.warning("step %d abandoned: %.0f s left, finishing it and saving takes about %.0f s",
                            self.step, stop.remaining_s, stop.needed_s)
                raise StepAbandoned()
            with span(timings, "train_seconds"):
                tensors = self.train_step.prepare(batch)
                train = self.train_step(batch, tensors, lr_factor=self.lr_factor)
            changed = train["skipped_steps"] < self.config.algorithm.num_mini_batches
            if changed:
                self.policy_version += 1
            else:
                log.warning("step %d: every optimizer step had a non-finite gradient norm; weights unchanged%s",
                            self.step, "" if self.placement.should_sync(False) else ", no weight sync")
            # after SIGTERM the servers are going away (a resumed run syncs them first: start)
            # ... and when a lost rollout server leaves the group or a restarted one re-joins (rl/replacement.py)
            sync = (self.placement.should_sync(changed) or self.weights.servers_changed()) and not stop.stop
            timings["weight_sync_seconds"] = self.sync_weights() if sync else 0.0
        self.train_seconds = timings["train_seconds"] + timings["weight_sync_seconds"]
        if not self.info.is_main:
            return None
        return self._row(batch, tensors, train, timings)

    def state_before_step(self) -> dict[str, Any] | None:
        return self._before_step

    def _row(self, batch, tensors, train: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
        """Rank 0: the step's metrics row."""
        stats = vars(batch.stats).copy()
        num_tokens = stats["num_tokens"]
        stats.update({f"reward/{name}_mean": value for name, value in stats.pop("components").items()})
        stats.update({f"reward/{key}": value for key, value in stats.pop("reward_counters").items()})
        stats.update(stats.pop("tools"))
        lr = self.config.optim.learning_rate * self.lr_factor(self.config.algorithm.num_mini_batches - 1)
        extra = {}
        if tensors.old_logprobs is not None:  # same weights, two engines: how far they disagree
            extra["logprob_mismatch"] = logprob_mismatch(tensors.old_logprobs, tensors.rollout_logprobs, tensors.mask)
        dev = self.info.device
        if dev.type == "cuda":
            passes = 3.0 + sum(x is not None for x in (tensors.old_logprobs, tensors.ref_logprobs, tensors.teacher_logprobs))
            extra["mfu"] = train_mfu(num_params=self.num_params, tokens=num_tokens,
                                     train_seconds=timings["train_seconds"], world_size=self.info.world_size,
                                     device_peak_flops=peak_flops(torch.cuda.get_device_name(dev)), passes=passes)
            extra["peak_gpu_memory_bytes"] = peak_gpu_memory_bytes()
        extra.update(tensors.reward_metrics)  # the learned reward's scores and the total reward mean
        if self.trackers is not None and self.trackers.samples_due(self.step):
            self.trackers.log_samples(self.step, self.trackers.sample_table(self.step, batch.rows, self.tokenizer.decode))
        if batch.token_staleness is not None:  # per token (orchestrator/staleness.py)
            extra.update(batch.token_staleness)
        elif batch.staleness is not None:
            extra["staleness_mean"] = extra["staleness_max"] = batch.staleness
        return {"step": self.step, **stats, **train, **extra, "learning_rate": lr, **timings,
                "tokens_per_second": num_tokens / timings["step_seconds"], "policy_version": self.policy_version,
                **self.weights.row()}
