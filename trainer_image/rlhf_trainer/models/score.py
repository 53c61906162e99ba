"""A score model: a decoder and a linear `score` head (one scalar per position), laid
out and loaded like Hugging Face's `*ForSequenceClassification`, so what `method: rm`
trains exports as one and `reward.model` loads it back (`load_reward_model`)."""

from __future__ import annotations

import torch

from .loading import stored_dtype


class ScoreModel(torch.nn.Module):
    """A decoder and a linear `score` head: hidden state -> one scalar per position.
    Parameter names (`model.*`, `score.weight`) are those of Hugging Face's
    `*ForSequenceClassification`, whose config it carries, so the export loads as one."""

    def __init__(self, path: str, pad_token_id: int | None, *, require_head: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        from transformers import AutoModelForSequenceClassification

        classifier, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=dtype, output_loading_info=True)
        if not hasattr(classifier, "score"):
            raise ValueError(f"model.path: {type(classifier).__name__} has no `score` head; method rm supports "
                             "decoder families with one (Qwen2, Llama, Mistral, ...)")
        self.config = classifier.config
        if self.config.pad_token_id is None:  # Hugging Face pools at the last non-padding token
            self.config.pad_token_id = pad_token_id
        self.config.architectures = [type(classifier).__name__]
        self.model, self.score = classifier.model, classifier.score
        if any(k.startswith("score.") for k in info["missing_keys"]):  # a new head (not a reward model's)
            if require_head:
                raise ValueError(f"reward.model.path: {path} has no trained score head: not a reward model "
                                 "(train one with method: rm)")
            torch.nn.init.zeros_(self.score.weight)  # scores start at 0, equal on every rank
        self._rlhf_export_dtype = stored_dtype(path)

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def activation_checkpointing_enable(self, kwargs: dict) -> None:
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def load_reward_model(path: str, device: torch.device, pad_token_id: int | None,
                      dtype: torch.dtype = torch.float32) -> ScoreModel:
    """The reward model of `path` (frozen; stored in `dtype`: bf16 on GPUs)."""
    model = ScoreModel(path, pad_token_id, require_head=True, dtype=dtype)
    if model.config.num_labels != 1:
        raise ValueError(f"reward.model.path: {path} has {model.config.num_labels} labels; a reward model has 1 "
                         "(what method: rm exports)")
    return model.to(device).eval().requires_grad_(False)
