"""The run loop of the offline methods (`method: sft | rm | dpo`), on every trainer process
(resume, save, evaluation, records and clean-up: loop.py).

Each step takes `schedule.promptsPerStep` examples (a pure function of the step, so a
resume needs no data state) and makes one optimizer step (offline/step.py). The rm model
is exported as a Hugging Face sequence classifier (`score` head, 1 label: models/score.py).

Same shared parts as RL: the model loading and parallel layouts (FSDP2, TP for sft and
dpo), the packed per-document attention, the chunked (vocabulary-parallel) log-prob head,
the optimizer and LR schedule, DCP checkpoints, `metrics.jsonl` and Prometheus, progress
on the job's status, the final export. Held-out examples (`evaluation.heldOutFraction`)
are scored before the first step, every `evaluation.everySteps` steps and after the last
(`eval/held_out/...` keys).
"""

from __future__ import annotations

import time
from typing import Any

from rlhf_contract.trainer_config import TrainerConfig

from ..checkpoint import Parts
from ..distributed import DistInfo
from ..loop import LoopBase
from ..engine import build_engine, load_models
from ..models.loading import host_until_sharded
from ..optim import schedule_factor
from .data import OfflineData
from .step import OfflineStep

HELD_OUT = "held_out"
"""The name of the held-out examples in the evaluation metrics (`eval/held_out/<metric>`)."""


class OfflineLoop(LoopBase):
    def __init__(self, config: TrainerConfig, info: DistInfo, *, output_dir: str):
        super().__init__(config, info, output_dir=output_dir)
        o, s = config.optim, config.schedule
        self.data = OfflineData(config.method, config.data, self.tokenizer, seed=s.seed,
                                batch_size=s.prompts_per_step, budget=o.max_tokens_per_micro_batch,
                                held_out_fraction=config.evaluation.held_out_fraction if config.evaluation else 0.0)
        trained = None
        if config.method == "rm":
            from ..models.score import ScoreModel

            # on GPUs it stays on the host: FSDP moves it layer by layer as it shards it (no GPU holds it whole)
            trained = ScoreModel(config.model_path, self.tokenizer.pad_token_id).to(host_until_sharded(info.device))
        self.model, self.ref, self.layout = load_models(config, info, trained=trained,
                                                        reference=config.reference_model())
        self.engine = build_engine(self.model, config, causal_lm=trained is None)
        self.train_step = OfflineStep(config, self.engine, self.ref, self.layout, info.device)

    def parts(self) -> Parts:
        return {"policy": self.engine}

    def extra_state(self) -> dict[str, Any]:
        return {"method": self.config.method}

    def evaluate(self, step: int) -> dict[str, Any]:
        if not self.data.eval:
            return {}
        return {f"eval/{HELD_OUT}/{k}": v for k, v in self.train_step.evaluate(self.data.eval).items()}

    def run_step(self) -> dict[str, Any]:
        s = self.config.schedule
        start = time.perf_counter()
        examples = self.data.batch(self.step)
        factor = schedule_factor(self.config.optim, self.step - 1, s.total_steps)
        row: dict[str, Any] = {"step": self.step, **self.train_step(examples, factor)}
        seconds = time.perf_counter() - start
        tokens = sum(seq.length for ex in examples for seq in ex.sequences)
        row.update(learning_rate=self.config.optim.learning_rate * factor, step_seconds=seconds,
                   tokens_per_second=tokens / seconds, num_examples=len(examples),
                   dropped_examples=self.data.num_dropped, skipped_rows=self.data.num_skipped)
        return row
