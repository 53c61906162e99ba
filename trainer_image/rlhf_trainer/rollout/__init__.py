"""Async rollout client: prompts as token ids to OpenAI-compatible servers, samples back
as token ids + logprobs."""

from .client import RolloutClient, RolloutError, Sample, prompt_seed

__all__ = ["RolloutClient", "RolloutError", "Sample", "prompt_seed"]
