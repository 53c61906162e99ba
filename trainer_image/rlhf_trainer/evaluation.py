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
    def __init__(self, config: TrainerConfig, tokenizer: Any, client: Any, scorer: Any):
        from .data.prompts import PromptSource

        self.spec: EvaluationSpec = config.evaluation
        self.config, self.tokenizer, self.client, self.scorer = config, tokenizer, client, scorer
        self.prompts: dict[str, list[Any]] = {}
        for d in self.spec.datasets:
            data = DataSpec(**{**config.data.model_dump(), "path": d.path, "split": d.split, "shuffle": False})
            try:
                source = PromptSource(data, tokenizer, seed=config.schedule.seed + EVAL_SEED_OFFSET)
            except ValueError as err:
                raise ValueError(f"evaluation.datasets[{d.name}].{err}") from None
            available = len(source._rows) if source._rows else BUILTIN_EVAL_PROMPTS
            self.prompts[d.name] = source.next_batch(min(d.max_prompts or available, available))
        eos = tokenizer.eos_token_id
        s = config.sampling
        self.stop = [eos] if eos is not None else None
        self.sampled = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}

    def due(self, step: int) -> bool:
        """Score after `step` (0: before the first step)?"""
        every, total = self.spec.every_steps, self.config.schedule.total_steps
        return step == 0 or step == total or bool(every and step % every == 0)

    def _scores(self, prompts: list[Any], samples: list[list[Any]]) -> list[list[float]]:
        items = [(self.tokenizer.decode(x.token_ids, skip_special_tokens=True), p.answer, p.extra_info)
                 for p, group in zip(prompts, samples) for x in group]
        flat = iter(score for _, score in self.scorer.score_batch(items))
        return [[next(flat) for _ in group] for group in samples]

    def run(self, step: int) -> dict[str, float]:
        """The metrics of every dataset (keys `eval/<name>/...`)."""
        out: dict[str, float] = {}
        k, max_tokens = self.spec.samples_per_prompt, self.config.sampling.max_tokens
        for name, prompts in self.prompts.items():
            ids = [p.token_ids for p in prompts]
            seed = (self.config.schedule.seed * 1_000_003 + step) * 64 + 63  # apart from training's rounds
            if self.spec.greedy:
                greedy = self.client.generate_sync(ids, n=1, max_tokens=max_tokens, seed=seed, temperature=0.0,
                                                   top_p=1.0, top_k=-1, stop_token_ids=self.stop)
                scores = self._scores(prompts, greedy)
                out[f"eval/{name}/greedy_score"] = sum(s[0] for s in scores) / len(scores)
            sampled = self.client.generate_sync(ids, n=k, max_tokens=max_tokens, seed=seed, stop_token_ids=self.stop,
                                                **self.sampled)
            scores = self._scores(prompts, sampled)
            out[f"eval/{name}/mean_score"] = sum(sum(s) for s in scores) / (k * len(scores))
            out[f"eval/{name}/pass@{k}"] = sum(max(s) >= 1.0 for s in scores) / len(scores)
        log.info("eval after step %d: %s", step, ", ".join(f"{key} {v:.3f}" for key, v in out.items()))
        return out
