"""The models of an RL job: the policy and its optimizer, the frozen reference (when
`algorithm.klCoef` is set), the critic and its optimizer (PPO), the learned reward model
(`reward.model`), built and laid out by the shared loader (models/loading.py).

The critic and the reward model are read on the host and moved to the GPU by FSDP2 one
decoder layer at a time as it shards them (`fully_shard` moves a module's states to its
mesh's device): no GPU holds either whole. The reward model is bf16 on GPUs; the critic,
which trains, keeps fp32 master weights and is checkpointed like the policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..distributed import DistInfo
from ..models.loading import host_until_sharded, load_models
from ..optim import optimizer_for
from ..parallel.parallelize import Layout


@dataclass
class Models:
    """What the train step updates and reads."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ref: torch.nn.Module | None = None
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    reward_model: torch.nn.Module | None = None
    """The reward model (`reward.model`), frozen."""

    def parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """The trained (model, optimizer) pairs by checkpoint name."""
        parts = {"policy": (self.policy, self.optimizer)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_optimizer)
        return parts


def build_models(config: TrainerConfig, info: DistInfo, pad_token_id: int | None = None) -> tuple[Models, Layout]:
    a, o = config.algorithm, config.optim
    critic = reward_model = None
    if a.critic:
        from ..models.critic import ValueModel

        critic = ValueModel(config.model_path).to(host_until_sharded(info.device))
    if config.reward.model is not None:
        from ..models.score import load_reward_model

        # frozen: bf16 on GPUs (what it computes in), no optimizer state
        reward_model = load_reward_model(config.reward.model.path, host_until_sharded(info.device), pad_token_id,
                                         torch.bfloat16 if info.device.type == "cuda" else torch.float32)
    policy, ref, layout = load_models(config, info, with_ref=bool(a.kl_coef), critic=critic, reward_model=reward_model)
    critic_optimizer = optimizer_for(critic, o, a.critic_learning_rate) if critic is not None else None
    return Models(policy, optimizer_for(policy, o), ref, critic, critic_optimizer, reward_model), layout
