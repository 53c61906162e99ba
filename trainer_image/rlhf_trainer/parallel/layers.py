"""Where the decoder layers of a Hugging Face causal LM are (Qwen2 / Llama families):
the unit of FSDP2 sharding, tensor-parallel plans and activation checkpointing."""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (or of its decoder)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at .model.layers")
    return list(layers)
