"""What every method's run loop shares, on every trainer process: the tokenizer and the
seed, resume from the newest complete checkpoint, checkpoints every `schedule.saveEvery`
steps and at the end, evaluation (before the first step, every `evaluation.everySteps`
and after the last), the step's row in `metrics.jsonl` / Prometheus / the trackers
(tracking.py) and on the job's status (rank 0), the final export, and clean-up in `finally`.

A method is a subclass (rl/loop.py, offline/loop.py) that provides `parts()` (the engines of
the trained models a checkpoint holds, engine/; "policy" is the one exported),
`run_step()` (one step; its metrics row on the process that records, else None), and
optionally `start()`,
`evaluate(step)`, `extra_state()` / `load_extra_state(state)`, `finish()` and `close()`.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from rlhf_contract.outputs import FINAL, HUB_MODELS
from rlhf_contract.trainer_config import TrainerConfig

from .checkpoint import Parts, latest_checkpoint, load_checkpoint, resume_checkpoint, save_checkpoint
from .distributed import DistInfo, broadcast_object
from .preemption import STOP, Preempted, StepAbandoned

log = logging.getLogger("rlhf_trainer")

LOGGED_KEYS = ("reward_mean", "loss", "accuracy")
"""The keys of a row that the step's log line shows, when present."""


class LoopBase(ABC):
    def __init__(self, config: TrainerConfig, info: DistInfo, *, output_dir: str):
        from transformers import AutoTokenizer

        self.config, self.info = config, info
        self.output_dir = Path(output_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        torch.manual_seed(config.schedule.seed)
        self.step = 0
        self.metrics = self.progress = self.trackers = self.publisher = self.published = None
        self.last_row: dict[str, Any] = {}
        self.trainable_parameters = 0
        self.save_seconds = 0.0
        """How long the last checkpoint took (0: none saved yet), for the SIGTERM decision."""
        if info.is_main:
            from .metrics import MetricsWriter
            from .progress import ProgressReporter

            self.metrics = MetricsWriter(self.output_dir)
            self.progress = ProgressReporter.from_config(config)  # no-op outside a cluster
            from .storage.publish import Publisher

            self.publisher = Publisher(config.output.uri, config.output.hub, self.output_dir)

    # ---- what a method provides -----------------------------------------------------

    @abstractmethod
    def parts(self) -> Parts:
        """See the module docstring."""

    @abstractmethod
    def run_step(self) -> dict[str, Any] | None:
        """See the module docstring."""

    def start(self) -> None:
        """Before the first step (after a resume)."""

    def evaluate(self, step: int) -> dict[str, Any]:
        """Collective: the evaluation metrics after `step` (0: before the first step)."""
        return {}

    def extra_state(self) -> dict[str, Any]:
        """What a checkpoint holds besides the models and the step (rank 0's is kept)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore `extra_state()` from a checkpoint's trainer state."""

    def finish(self) -> None:
        """After the final export."""

    def close(self) -> None:
        """Release what the method holds (always runs)."""

    # ---- shared -----------------------------------------------------------------------

    def evaluation_due(self, step: int) -> bool:
        """Evaluate after `step`? Before the first step, every `evaluation.everySteps`, after the last."""
        every = self.config.evaluation.every_steps if self.config.evaluation is not None else 0
        total = self.config.schedule.total_steps
        return step == 0 or step == total or bool(every and step % every == 0)

    def resume_if_possible(self) -> None:
        path = broadcast_object(resume_checkpoint(self.output_dir) if self.info.is_main else None)
        if path is None:
            return
        state = load_checkpoint(path, self.parts())
        self.step = int(state["step"])
        self.load_extra_state(state)
        if self.metrics is not None:
            self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", path, self.step)

    def save(self, extra_state: dict[str, Any] | None = None, *, hub: bool = True) -> None:
        """Collective: a checkpoint of this step (with `extra_state`, else `extra_state()`),
        with `output.hub.every` a loadable model of it too; then, on rank 0, their upload to
        `output.uri` / `output.hub` starts in the background (storage/publish.py) once the
        previous one is over. `hub=False` (SIGTERM's save): no model export in the grace period."""
        # at most one upload in flight, and none of a checkpoint pruned below
        if self.publisher is not None and (waited := self.publisher.wait()) > 0.01:
            log.info("step %d: waited %.2f s for the previous checkpoint's upload", self.step, waited)
        start = time.monotonic()
        state = broadcast_object(self.extra_state() if extra_state is None else extra_state)
        path = save_checkpoint(self.output_dir, self.step, self.parts(), state, keep=self.config.output.keep_checkpoints)
        self.save_seconds = time.monotonic() - start  # the write alone (the uploads are off this path)
        model = self.export_for_hub() if hub else None
        if self.publisher is not None and path != self.published:
            self.publisher.checkpoint(path, model)
            self.published = path
        elif self.publisher is not None:  # the last step's, saved again after its row: the rows it missed
            self.publisher.metrics()

    def export_for_hub(self) -> Path | None:
        """Collective: with `output.hub.every` due at this step (not the last: `final/` goes
        then), the policy as a Hugging Face model in `hub/step-N/` with its card (rank 0's
        path; deleted once pushed)."""
        hub, total = self.config.output.hub, self.config.schedule.total_steps
        if hub is None or not hub.every or self.step % hub.every or self.step >= total:
            return None
        name = f"{HUB_MODELS}/step-{self.step}"
        self.parts()["policy"].export(self.output_dir, self.tokenizer, name=name)
        if not self.info.is_main:
            return None
        self.write_card(self.output_dir / name)
        return self.output_dir / name

    def write_card(self, model_dir: Path) -> None:
        """Rank 0: the model card of `model_dir` (storage/model_card.py)."""
        from .storage.model_card import write_card
        from .tracking import run_config

        write_card(model_dir, run_config(self.config.job_name), self.output_dir, base_dir=Path(self.config.model_path),
                   links=self.trackers.links() if self.trackers is not None else None)

    def publish_final(self) -> None:
        """Rank 0: `final/README.md` (the model card), then, after the last checkpoint's
        upload, `final/` to `output.uri` / `output.hub`."""
        final_dir = self.output_dir / FINAL
        if final_dir.is_dir():
            self.write_card(final_dir)
            self.publisher.final(final_dir)
        self.publisher.wait()

    def state_before_step(self) -> dict[str, Any] | None:
        """What an abandoned step's checkpoint holds besides the models (rank 0's)."""
        return None

    def preempt(self, extra_state: dict[str, Any] | None = None) -> Preempted:
        """Collective, after SIGTERM: the checkpoint of the step reached (none before the first)."""
        if self.step > 0:
            self.save(extra_state, hub=False)
            if self.progress is not None:
                self.report(self.last_row)
        log.warning("stopped by SIGTERM at step %d (%.1f s of the grace period left)", self.step, STOP.remaining_s())
        return Preempted(self.step)

    def report(self, row: dict[str, Any]) -> None:
        """status.progress of the job (rank 0; rate-limited, never raises)."""
        newest = latest_checkpoint(self.output_dir)
        self.progress.report(self.step, reward_mean=row.get("reward_mean"), policy_version=row.get("policy_version"),
                             last_checkpoint=str(newest) if newest is not None else None)

    def record(self, row: dict[str, Any]) -> None:
        """Rank 0: the step's row into metrics.jsonl, Prometheus and the trackers, the job's
        status, the log."""
        row.setdefault("trainable_parameters", self.trainable_parameters)
        self.metrics.write(row)
        if self.trackers is not None:
            self.trackers.log(self.step, row)
        self.last_row = row
        self.report(row)
        shown = " ".join(f"{k.removesuffix('_mean')} {row[k]:.4f}" for k in LOGGED_KEYS if row.get(k) is not None)
        log.info("step %d/%d %s %.2fs", self.step, self.config.schedule.total_steps, shown, row["step_seconds"])

    def run(self) -> None:
        s = self.config.schedule
        finished = False
        try:
            if self.info.is_main:
                from .tracking import Trackers

                self.trackers = Trackers(self.config.tracking, self.output_dir, job_name=self.config.job_name,
                                         resume_step=self.step)
            final = self.parts()["policy"]
            self.trainable_parameters = final.trainable_parameters()
            log.info("%s: %d parameters, %d trained%s", type(final.model).__name__, final.total_parameters(),
                     self.trainable_parameters, " (LoRA adapters)" if self.config.lora else "")
            self.start()
            before = self.evaluate(0) if self.step == 0 else {}
            while self.step < s.total_steps:
                if STOP.agree(0.0, self.info.device).stop:
                    raise self.preempt()
                self.step += 1
                try:
                    row = self.run_step()
                except StepAbandoned:
                    self.step -= 1
                    raise self.preempt(self.state_before_step()) from None
                if self.step == 1 and row is not None:  # scored before the first step
                    row.update(before)
                if self.evaluation_due(self.step):
                    scores = self.evaluate(self.step)
                    if row is not None:
                        row.update(scores)
                if s.save_every and self.step % s.save_every == 0:
                    self.save()
                if row is not None and self.metrics is not None:
                    self.record(row)
            if s.save_every:
                self.save()
            final.export(self.output_dir, self.tokenizer)
            if self.publisher is not None:
                self.publish_final()
            if self.progress is not None:
                self.report(self.last_row)  # the final checkpoint
            self.finish()
            finished = True
        finally:
            if self.publisher is not None:
                self.publisher.close()  # an upload in flight ends (a failed run's newest checkpoint still goes up)
            if self.trackers is not None:
                self.trackers.close(success=finished)
            self.close()
            if self.progress is not None:
                self.progress.close()
