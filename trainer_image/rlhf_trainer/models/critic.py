"""The critic for PPO: a value head on a copy of the policy's decoder.

Departure: the head is initialised to zero (values start at 0), rather than from a reward
model; a separate critic checkpoint path is not supported yet.
"""

from __future__ import annotations

import torch


class ValueModel(torch.nn.Module):
    """Decoder of a causal LM + a linear head: hidden state -> scalar value per position."""

    def __init__(self, path: str):
        super().__init__()
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.config = lm.config
        self.model = lm.model  # `.model.layers` is what FSDP wraps per layer
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def activation_checkpointing_enable(self, kwargs: dict) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Values [b, L]; extra keyword arguments (an attention mask, context-parallel
        document ids) go to the decoder."""
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1)
