"""The training engines behind one interface (engine/base.py): FSDP2 with AdamW
(engine/fsdp2.py, the default) and DeepSpeed ZeRO (engine/zero.py, `trainer.engine:
deepspeed`). `engine_type` is the one place that reads which engine a job asked for, and
`checkpoint_engine` the one place that tells which engine wrote a checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from .base import Engine, EngineStateError
from .fsdp2 import Fsdp2Engine

__all__ = ["Engine", "EngineStateError", "Fsdp2Engine", "build_engine", "checkpoint_engine", "engine_type",
           "load_models"]


def engine_type(optim) -> type[Engine]:
    """The engine class of the trainer config's `optim` (`trainer.engine`)."""
    if optim.engine == "deepspeed":
        from .zero import ZeroEngine

        return ZeroEngine
    return Fsdp2Engine


def checkpoint_engine(step_dir, part: str = "policy") -> type[Engine]:
    """The engine class that wrote `part` of the checkpoint `step_dir` (read from its files:
    `rlhfctl export` has no job spec to ask), whose `read_trained` reads it back."""
    from .zero import ZeroEngine

    return ZeroEngine if ZeroEngine.wrote(step_dir, part) else Fsdp2Engine


def load_models(config, info, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module | None, Any]:
    """Load and lay out the job's models for its engine (models/loading.py `load_models`
    under FSDP2, engine/zero.py `load_for_zero` under DeepSpeed): (trained, reference, layout)."""
    return engine_type(config.optim).load_models(config, info, **kwargs)


def build_engine(model: torch.nn.Module, config, learning_rate: float | None = None, *,
                 causal_lm: bool = True) -> Engine:
    """The engine that trains `model` (laid out by `load_models`) under the trainer config.
    A causal LM with LoRA adapters (`model.lora`) exports them in peft's format too; a
    score model or a critic exports merged weights only."""
    adapter = (config.lora, config.model_path) if config.lora is not None and causal_lm else None
    return engine_type(config.optim).train(model, config.optim, learning_rate, adapter=adapter)
