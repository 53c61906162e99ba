"""Evaluation during RL training (`spec.evaluation`), on rank 0, through the rollout
servers: each held-out prompt set is scored with the job's reward before the first step,
every `everySteps` steps (after that step's weight sync: the servers hold the new policy)
and after the last one.

Per dataset, in the step's metrics row:
  eval/<name>/greedy_score   mean score of one temperature-0 response per prompt
  eval/<name>/mean_score     mean score of k responses per prompt at the job's sampling
  eval/<name>/pass@k         fraction of prompts with a response scoring at least 1
and the Prometheus gauge `rlhf_eval{dataset, metric}` (metric: greedy_score, mean_score,
pass_at_k). Single-turn generation only: with `spec.environment` the sets are scored on
their first turn. Sampling seeds depend on the step, so a resumed run repeats them.
Generation and scoring go through the orchestrator's sampler (the same client, reward
and stop tokens as training).
"""

from __future__ import annotations

import logging
from typing import Any

from rlhf_contract.api.models import DataSpec, EvaluationSpec
from rlhf_contract.trainer_config import TrainerConfig

log = logging.getLogger(__name__)

BUILTIN_EVAL_PROMPTS = 64
EVAL_SEED_OFFSET = 7919
"""Built-in tasks: the eval prompts come from another seed than training's."""


class Evaluator:
    def __init__(self, config: TrainerConfig, sampler: Any):
        from ..data.prompts import PromptSource

        self.spec: EvaluationSpec = config.evaluation
        self.config, self.sampler = config, sampler
        self.prompts: dict[str, list[Any]] = {}
        for d in self.spec.datasets:
            data = DataSpec(**{**config.data.model_dump(), "path": d.path, "config": d.config, "split": d.split, "shuffle": False})
            try:
                source = PromptSource(data, sampler.tokenizer, seed=config.schedule.seed + EVAL_SEED_OFFSET)
            except ValueError as err:
                raise ValueError(f"evaluation.datasets[{d.name}].{err}") from None
            available = source.num_rows or BUILTIN_EVAL_PROMPTS
            self.prompts[d.name] = source.next_batch(min(d.max_prompts or available, available))

    def run(self, step: int) -> dict[str, float]:
        """The metrics of every dataset (keys `eval/<name>/...`)."""
        out: dict[str, float] = {}
        k = self.spec.samples_per_prompt
        seed = (self.config.schedule.seed * 1_000_003 + step) * 64 + 63  # apart from training's rounds
        for name, prompts in self.prompts.items():
            if self.spec.greedy:
                _, scored = self.sampler.generate_scored(prompts, n=1, seed=seed,
                                                         sampling={"temperature": 0.0, "top_p": 1.0, "top_k": -1})
                out[f"eval/{name}/greedy_score"] = sum(g[0][1] for g in scored) / len(scored)
            _, scored = self.sampler.generate_scored(prompts, n=k, seed=seed)
            scores = [[result[1] for result in g] for g in scored]
            out[f"eval/{name}/mean_score"] = sum(sum(s) for s in scores) / (k * len(scores))
            out[f"eval/{name}/pass@{k}"] = sum(max(s) >= 1.0 for s in scores) / len(scores)
        log.info("eval after step %d: %s", step, ", ".join(f"{key} {v:.3f}" for key, v in out.items()))
        return out
