"""The rank-0 orchestrator: one `RolloutBatch` per step.

`collect(step)` takes prompts from the data source, has the sampler generate and score
them, applies dynamic sampling, and returns the rows with their statistics. It never
touches a model or a process group: the run loop broadcasts the batch to every rank.
It owns the rollout client for the run (`check_servers()` before the first step,
`close()` at the end) and the evaluator of `spec.evaluation` (`evaluate(step)`), which
generates through the same sampler.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from rlhf_contract.pod import ENV_JUDGE_ENDPOINTS
from rlhf_contract.trainer_config import TrainerConfig

from ..data.sequences import Row
from ..rollout.servers import ServerInfo, handshake
from .filtering import collect_groups
from .sampler import Sampler
from .types import RolloutBatch, RolloutStats


class Orchestrator:
    def __init__(self, config: TrainerConfig, *, data: Any, sampler: Sampler, output_dir: Path):
        self.config, self.data, self.sampler, self.output_dir = config, data, sampler, output_dir
        self.evaluator = None
        if config.evaluation is not None and config.evaluation.datasets:
            from .evaluation import Evaluator

            self.evaluator = Evaluator(config, sampler)

    @classmethod
    def build(cls, config: TrainerConfig, tokenizer: Any, endpoints: list[str], output_dir: Path) -> "Orchestrator":
        from ..data.prompts import PromptSource
        from ..rewards import build_reward
        from ..rollout import RolloutClient

        env_step, gem_id = None, None
        if config.environment is not None and config.environment.gem is not None:
            from ..rollout import gem_env

            env_step, gem_id = gem_env.step, config.environment.gem
            gem_env.make(gem_id)  # fails now, naming environment.gem, if it cannot be made
        elif config.environment is not None:
            from ..rollout.multi_turn import load_environment

            env_step = load_environment(config.environment.file)
        tools = None
        if config.tools is not None:
            from ..rollout.tool_episodes import ToolRollout

            tools = ToolRollout(config.tools, tokenizer)
        elif config.agent is not None:
            from ..rollout.agent_episodes import AgentRollout

            tools = AgentRollout(config.agent, tokenizer)
        data = PromptSource(config.data, tokenizer, seed=config.schedule.seed, gem_id=gem_id)
        reward = build_reward(config.reward, job_name=config.job_name, namespace=config.namespace,
                              judge_url=os.environ.get(ENV_JUDGE_ENDPOINTS))
        return cls(config, data=data, sampler=Sampler(config, RolloutClient(endpoints, timeout_s=config.rollout_request_timeout_seconds), reward, tokenizer, env_step,
                                                    tools),
                   output_dir=output_dir)

    # ---- the rollout client's lifecycle -------------------------------------------

    def check_servers(self) -> list[ServerInfo]:
        """The handshake (rollout/servers.py): wait for the rollout servers (as long as their
        startup allowance) and read what they are; exits 2 naming `rollout.image` for a server
        without weight transfer. The weight-sync sender forms its group from the result. The
        job's own judge servers (RLHF_JUDGE_ENDPOINTS) are waited for first, as long."""
        judges = [u for u in os.environ.get(ENV_JUDGE_ENDPOINTS, "").split(",") if u]
        if judges:  # the job's own judge servers load their model meanwhile
            from ..rewards.judge import wait_for_judges

            wait_for_judges(judges, timeout_s=self.config.rollout_startup_timeout_seconds)
        return handshake(self.sampler.client.endpoints, startup_timeout_s=self.config.rollout_startup_timeout_seconds)

    @property
    def requests_sent(self) -> dict[str, int]:
        """Generation requests sent to each endpoint so far."""
        return self.sampler.client.requests_sent

    def close(self) -> None:
        if self.sampler.tools is not None:  # its workers live on the client's event loop
            self.sampler.tools.close(self.sampler.client)
        self.sampler.client.close()

    def evaluate(self, step: int) -> dict[str, float]:
        """`spec.evaluation`'s metrics after `step` ({} without held-out sets)."""
        return self.evaluator.run(step) if self.evaluator is not None else {}

    # ---- one step -----------------------------------------------------------------

    def collect(self, step: int) -> RolloutBatch:
        a = self.config.algorithm
        self.sampler.reward.begin_step(self.trainer_state(step))

        def sample(num_prompts: int, round_: int) -> list[list[Row]]:
            return self.sampler.sample_groups(self.data.next_batch(num_prompts), step=step, round_=round_)

        groups, sampled, dropped = collect_groups(sample, self.config.schedule.prompts_per_step,
                                                  dynamic=bool(a.dynamic_sampling), max_rounds=a.max_sampling_rounds)
        rows = [row for g in groups for row in g]
        if self.config.output.save_rollouts:
            self._save_rollouts(step, rows)
        stats = rollout_stats(groups, sampled=sampled, dropped=dropped, dropped_prompts=getattr(self.data, "num_dropped", 0),
                              skipped_rows=getattr(self.data, "num_skipped", 0))
        reward = self.sampler.reward  # a judge's parse failures and tokens, a python function's log_metric
        stats.reward_counters = {**reward.drain_counters(), **reward.drain_metrics()}
        stats.tools = self.sampler.drain_tool_metrics()
        return RolloutBatch(rows, self.config.sampling.samples_per_prompt, stats, step=step)

    def trainer_state(self, step: int) -> Any:
        """TRL's `trainer_state` for the reward functions of `step` (rewards/forms.py):
        `global_step` counts the steps already trained, `epoch` the passes over the data so far
        (0 for a built-in task, which has no end)."""
        from ..rewards.forms import trainer_state

        s = self.config.schedule
        rows = getattr(self.data, "num_rows", 0)
        position = getattr(self.data, "position", 0)
        return trainer_state(global_step=step - 1, max_steps=s.total_steps, epoch=position / rows if rows else 0.0,
                             num_train_epochs=math.ceil(s.total_steps * s.prompts_per_step / rows) if rows else 0,
                             save_steps=s.save_every, train_batch_size=s.prompts_per_step)

    def _save_rollouts(self, step: int, rows: list[Row]) -> None:
        folder = self.output_dir / "rollouts"
        folder.mkdir(parents=True, exist_ok=True)
        decode = self.sampler.tokenizer.decode
        with open(folder / f"step-{step}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps({
                    "prompt": decode(r.prompt_ids), "response": decode(r.response_ids),
                    "prompt_ids": r.prompt_ids, "response_ids": r.response_ids, "loss_mask": r.mask(),
                    "logprobs": r.rollout_logprobs, "reward": r.reward, "score": r.score, "truncated": r.truncated,
                    **({"extra": r.extra} if r.extra else {}),
                }, default=repr) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])


def rollout_stats(groups: list[list[Row]], *, sampled: int, dropped: int, dropped_prompts: int = 0,
                  skipped_rows: int = 0) -> RolloutStats:
    """The statistics of a step's groups (`sampled` groups generated, `dropped` of them by
    dynamic sampling)."""
    rows = [row for g in groups for row in g]
    n = len(rows)
    rewards = [r.reward for r in rows]
    lengths = [len(r.response_ids) for r in rows]
    mean = sum(rewards) / n
    names = list(rows[0].components or {}) if rows else []
    return RolloutStats(
        reward_mean=mean,
        reward_std=(sum((x - mean) ** 2 for x in rewards) / n) ** 0.5,
        reward_min=min(rewards), reward_max=max(rewards),
        score_mean=sum(r.score for r in rows) / n,
        response_length_mean=sum(lengths) / n, response_length_min=min(lengths), response_length_max=max(lengths),
        truncated_fraction=sum(r.truncated for r in rows) / n,
        zero_std_group_fraction=sum(max(r.reward for r in g) - min(r.reward for r in g) <= 1e-9
                                    for g in groups) / len(groups),
        dropped_group_fraction=dropped / sampled,
        num_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in rows),
        dropped_prompts=dropped_prompts,
        skipped_rows=skipped_rows,
        components={name: _mean_of_applied([r.components[name] for r in rows]) for name in names},
    )


def _mean_of_applied(values: list[float]) -> float:
    """The mean of a reward function's values where it applied (NaN: it returned None), NaN
    when it applied to none (TRL's nanmean)."""
    applied = [v for v in values if not math.isnan(v)]
    return sum(applied) / len(applied) if applied else math.nan
