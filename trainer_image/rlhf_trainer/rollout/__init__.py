"""Async rollout client: prompts as token ids to OpenAI-compatible servers, samples back
as token ids + logprobs."""

from .client import (RolloutClient, RolloutError, RolloutImageError, Sample, ServerInfo, check_rollout_servers,
                     prompt_seed)

__all__ = ["RolloutClient", "RolloutError", "RolloutImageError", "Sample", "ServerInfo", "check_rollout_servers",
           "prompt_seed"]
