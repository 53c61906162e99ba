"""Tensor parallelism (DTensor) for Hugging Face Qwen2 / Llama causal LMs.

Megatron-style plan per decoder layer: q/k/v and gate/up projections are column-parallel
(each rank computes its own heads / its slice of the MLP width), o and down projections
are row-parallel (partial sums all-reduced back to a replicated hidden state). So each
layer costs two all-reduces forward and two backward.

The attention modules of transformers 5 reshape with `view(*shape, -1, head_dim)` and
`reshape(*shape, -1)`, so they already work on the local heads; the grouping ratio
`num_key_value_groups` does not change under TP. Attributes holding head counts
(`num_heads`, `num_key_value_heads`, present in some families) are divided anyway.

The embedding is row-parallel over the vocabulary (output all-reduced) and the LM head
column-parallel (each rank holds a slice of the vocabulary's rows). A plain call of the
head gathers the logits to every rank (`Replicate`), so other callers see ordinary full
logits; the trainer's log-prob head (models/logprob_head.py) instead works on the local
rows and reduces three numbers per token (vocabulary-parallel log-probs and entropy).

Simplifications: no sequence parallelism (norms and residuals are replicated, not
sharded over the sequence), no async TP. TP must divide both the query and the key/value head
counts.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from .layers import decoder_layers

LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
"""Submodule of a decoder layer -> parallel style (Qwen2 / Llama / Mistral naming)."""


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """Shard `model` in place over the 1-D tensor-parallel `tp_mesh`."""
    tp = tp_mesh.size()
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(
            f"trainer.parallelism: tensor parallel size ({tp}) must divide the model's "
            f"attention heads ({heads}) and key/value heads ({kv_heads})"
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))

    parallelize_module(
        model,
        tp_mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    if tied:
        # Both plans shard the shared [vocab, hidden] weight on dim 0: share one DTensor.
        model.lm_head.weight = model.model.embed_tokens.weight

    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {name: style() for name, style in LAYER_PLAN.items()})
        attn = layer.self_attn
        for attr in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(attn, attr, None), int):
                setattr(attn, attr, getattr(attn, attr) // tp)
    return model
