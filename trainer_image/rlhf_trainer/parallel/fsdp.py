"""FSDP2 (`fully_shard`) for Hugging Face decoder models.

Each decoder layer is its own FSDP unit (gathered just before use, freed after), then the
root takes the rest (embeddings, final norm, LM head), so tied embeddings stay in one unit.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (Qwen2 / Llama families)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at .model.layers")
    return list(layers)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` in place over the 1-D data-parallel `mesh`."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
