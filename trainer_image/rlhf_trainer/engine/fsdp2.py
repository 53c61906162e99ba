"""FSDP2 (or one plain process) with torch's AdamW: the default engine.

The model is laid out by parallel/parallelize.py (tensor parallel, context parallel,
activation checkpointing, `fully_shard`) when models/loading.py loads it; this engine adds
the optimizer side: AdamW over the trainable parameters (optim.py `adamw`), gradient
clipping by global norm over any mix of DTensors and plain tensors
(parallel/grad_norm.py), and a non-finite norm skipping the step. Checkpoints are
torch.distributed.checkpoint state dicts of the trainable parameters only (with LoRA: the
adapters; the frozen base is read again from `model.path`).

Offload (colocation): FSDP2's `nn.Module.to` keeps each parameter's sharded storage
registered (it re-derives its shard after the move), so the model moves with `to`; the
optimizer's state tensors move one by one. Gradients are dropped first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..models.loading import load_models
from ..parallel.grad_norm import clip_grad_norm
from .base import Engine, PlannedState, move_optimizer_state

TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Checkpoints hold what trains: with LoRA (models/lora.py) the adapters, not the frozen
base, which is read again from `model.path` on resume."""
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Loading: the frozen parameters are absent by design; every trained one was requested
from the checkpoint by `dcp.load` (which fails on a missing key), so nothing else is."""


class Fsdp2Engine(Engine):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 adapter: tuple[Any, str] | None = None):
        super().__init__(model, adapter=adapter)
        self.optimizer = optimizer

    @classmethod
    def train(cls, model: torch.nn.Module, optim, learning_rate: float | None = None, *,
              adapter: tuple[Any, str] | None = None) -> "Fsdp2Engine":
        """AdamW over `model`'s trainable parameters under the trainer config's `optim`."""
        from ..optim import adamw

        return cls(model, adamw(model, optim, learning_rate), adapter=adapter)

    @classmethod
    def planned_state(cls, optim, *, params: float, trained: float, shard: int, cuda: bool) -> PlannedState:
        """fp32 master weights, fp32 gradients reduce-scattered every micro-batch, fp32 AdamW
        state, all sharded over the FSDP ranks; frozen models in bf16 on GPUs, sharded alike."""
        lora = trained < params
        return PlannedState(
            trained=[("policy weights (fp32)", int(4 * params), ""),
                     ("policy gradients (fp32, sharded)", int(4 * trained),
                      "LoRA adapters only" if lora else "reduce-scattered every micro-batch"),
                     ("AdamW state (fp32)", int(8 * trained), "exp_avg + exp_avg_sq")],
            frozen_bytes=2 if cuda else 4, frozen_shard=shard, fsdp_copies=cuda or shard > 1)

    @classmethod
    def load_models(cls, config, info, **kwargs):
        """models/loading.py's layout (TP, CP, checkpointing, `fully_shard`, sharded loading)."""
        return load_models(config, info, **kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        self._check_loaded("backward")
        loss.backward()

    def step_or_skip(self, max_grad_norm: float) -> torch.Tensor | None:
        """The one host sync of an optimizer step."""
        self._check_loaded("step")
        norm = clip_grad_norm(self.model.parameters(), max_grad_norm)
        if bool(torch.isfinite(norm)):
            self.optimizer.step()
            return norm
        self.optimizer.zero_grad(set_to_none=True)
        return None

    def dcp_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=TRAINED_ONLY)
        return {"model": model_sd, "optim": optim_sd}

    def load_dcp_state(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=LOAD_TRAINED)

    def _move_states(self, device: torch.device, *, offload: bool) -> None:
        self.model.to(device)
        move_optimizer_state(self.optimizer, device)
