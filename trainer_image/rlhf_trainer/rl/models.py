"""The models of an RL job: the policy and its optimizer, the frozen reference (when
`algorithm.klCoef` is set), the frozen teacher (`method: distill`: loaded and laid out as
the reference is, from `distillation.teacher.path`), the critic and its optimizer (PPO),
the learned reward model (`reward.model`), built and laid out by the shared loader
(models/loading.py).

The critic and the reward model are read on the host and moved to the GPU by FSDP2 one
decoder layer at a time as it shards them (`fully_shard` moves a module's states to its
mesh's device): no GPU holds either whole. The reward model is bf16 on GPUs; the critic,
which trains, keeps fp32 master weights and is checkpointed like the policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..distributed import DistInfo
from ..engine import Engine, build_engine, load_models
from ..models.loading import host_until_sharded
from ..parallel.parallelize import Layout


@dataclass
class Models:
    """What the train step updates (through the engines) and reads."""

    engine: Engine
    """The policy's engine (its `model` is the policy)."""
    ref: torch.nn.Module | None = None
    critic_engine: Engine | None = None
    reward_model: torch.nn.Module | None = None
    """The reward model (`reward.model`), frozen."""
    teacher: torch.nn.Module | None = None
    """The distillation teacher (`method: distill`), frozen."""

    @property
    def policy(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def critic(self) -> torch.nn.Module | None:
        return self.critic_engine.model if self.critic_engine is not None else None

    def engines(self) -> list[Engine]:
        return [e for e in (self.engine, self.critic_engine) if e is not None]

    def parts(self) -> dict[str, Engine]:
        """The trained parts by checkpoint name."""
        parts = {"policy": self.engine}
        if self.critic_engine is not None:
            parts["critic"] = self.critic_engine
        return parts


def build_models(config: TrainerConfig, info: DistInfo, pad_token_id: int | None = None) -> tuple[Models, Layout]:
    a = config.algorithm
    critic = reward_model = None
    if a.critic:
        from ..models.critic import ValueModel

        critic = ValueModel(config.model_path).to(host_until_sharded(info.device))
    if config.reward.model is not None:
        from ..models.score import load_reward_model

        # frozen: bf16 on GPUs (what it computes in), no optimizer state
        reward_model = load_reward_model(config.reward.model.path, host_until_sharded(info.device), pad_token_id,
                                         torch.bfloat16 if info.device.type == "cuda" else torch.float32)
    # the teacher takes the reference's place (a distill job has no KL to the starting model: the contract's rule)
    reference = config.reference_model()
    policy, frozen, layout = load_models(config, info, reference=reference, critic=critic, reward_model=reward_model)
    critic_engine = build_engine(critic, config, a.critic_learning_rate, causal_lm=False) if critic is not None else None
    ref, teacher = (None, frozen) if reference is not None and reference.teacher else (frozen, None)
    return Models(build_engine(policy, config), ref, critic_engine, reward_model, teacher), layout
