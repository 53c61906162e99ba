"""Load the policy, the frozen reference model and the critic, lay them out over the
trainer's processes (parallel/parallelize.py), and give the policy and the reference the
chunked log-prob head (train/micro_batches.py).

The policy loads in fp32 (master weights; on CUDA FSDP2 computes in bf16); the
reference model never trains, so it has no optimizer state. Simplification: every rank
reads the whole checkpoint before sharding (no meta-device loading yet).
"""

from __future__ import annotations

import torch

from rlhf_contract.trainer_config import TrainerConfig

from ..distributed import DistInfo
from ..parallel.parallelize import Layout, parallelize_models
from ..train.micro_batches import attach_logprob_head
from ..train.step import Models


def load_causal_lm(path: str, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def build_models(config: TrainerConfig, info: DistInfo) -> tuple[Models, Layout]:
    a, o = config.algorithm, config.optim
    policy = load_causal_lm(config.model_path, info.device)
    ref = load_causal_lm(config.model_path, info.device).eval().requires_grad_(False) if a.kl_coef else None
    critic = None
    if a.critic:
        from .critic import ValueModel

        critic = ValueModel(config.model_path).to(info.device)
    p = o.parallelism
    layout = parallelize_models(policy, ref=ref, critic=critic, world_size=info.world_size, tp=p.tensor_parallel,
                                cp=p.context_parallel, activation_checkpointing=p.activation_checkpointing,
                                device_type=info.device.type)
    for model in (policy, ref):
        if model is not None:
            attach_logprob_head(model, tensor_parallel=p.tensor_parallel > 1)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=o.learning_rate, weight_decay=o.weight_decay)
    critic_optimizer = None
    if critic is not None:
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=a.critic_learning_rate or o.learning_rate,
                                             weight_decay=o.weight_decay)
    return Models(policy, optimizer, ref, critic, critic_optimizer), layout
