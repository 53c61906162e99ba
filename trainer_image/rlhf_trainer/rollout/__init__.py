"""Async rollout client: prompts as token ids to OpenAI-compatible servers, samples back
as token ids + logprobs; the one start-up handshake with those servers (servers.py)."""

from .client import RolloutClient, RolloutError, Sample, prompt_seed
from .servers import RolloutImageError, ServerInfo, handshake

__all__ = ["RolloutClient", "RolloutError", "RolloutImageError", "Sample", "ServerInfo", "handshake", "prompt_seed"]
