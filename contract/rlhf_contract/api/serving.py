"""The rollout servers' own settings: `vllm serve` flags (`rollout.vllm`) and how colocated
servers take turns with the trainer (`rollout.colocated`)."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator

from .common import SpecModel


# Flags the operator sets itself (contract/rlhf_contract/pod.py serve_command), with the
# spec field that sets each: refused in rollout.vllm.extraArgs.
OWN_SERVE_FLAGS = {
    "--host": "(the operator's)", "--port": "(the operator's)", "--served-model-name": "metadata.name",
    "--tensor-parallel-size": "rollout.tensorParallelSize", "--dtype": "model.dtype", "--seed": "schedule.seed",
    "--max-model-len": "data.maxPromptLength + rollout.maxTokens", "--generation-config": "(the operator's)",
    "--weight-transfer-config": "(the operator's)", "--logprobs-mode": "(the operator's)",
    "--gpu-memory-utilization": "rollout.vllm.gpuMemoryUtilization", "--max-num-seqs": "rollout.vllm.maxNumSeqs",
    "--max-num-batched-tokens": "rollout.vllm.maxNumBatchedTokens",
    "--enable-prefix-caching": "rollout.vllm.enablePrefixCaching",
    "--no-enable-prefix-caching": "rollout.vllm.enablePrefixCaching", "--enforce-eager": "rollout.vllm.enforceEager",
    "--enable-sleep-mode": "rollout.placement", "--no-enable-sleep-mode": "rollout.placement",
    "--disable-sleep-mode": "rollout.placement", "--kv-cache-memory-bytes": "rollout.vllm.kvCacheMemoryBytes",
}


class VllmSpec(SpecModel):
    """Settings of the vLLM rollout servers (`vllm serve` flags); unset keeps vLLM's default."""

    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Fraction of each GPU's memory vLLM may use (weights, activations, KV cache):
    `--gpu-memory-utilization` (vLLM's default 0.9)."""
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)
    """Bytes of KV cache per GPU (`--kv-cache-memory-bytes`), instead of what is left under
    gpuMemoryUtilization: a fixed size that does not grow with the vLLM release or with what
    else is on the GPU (required with rollout.placement colocated)."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Sequences a server runs at once: `--max-num-seqs`."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Tokens per engine step: `--max-num-batched-tokens`."""
    enable_prefix_caching: bool | None = None
    """Reuse KV blocks of shared prompt prefixes (the group's samples share their prompt):
    `--[no-]enable-prefix-caching`. The cache is reset after every weight update."""
    enforce_eager: bool = False
    """No CUDA graphs (`--enforce-eager`): faster start-up, slower decoding."""
    extra_args: list[str] = Field(default_factory=list, max_length=32)
    """More `vllm serve` arguments, e.g. ["--kv-cache-dtype", "fp8"] or ["--block-size=32"].
    Each flag must be one the pinned vLLM accepts; flags the operator or the fields above set
    are refused (set those fields instead)."""

    @field_validator("extra_args")
    @classmethod
    def _known_flags(cls, args: list[str]) -> list[str]:
        from ..images import VLLM_VERSION
        from ..vllm_options import SERVE_OPTIONS

        for arg in args:
            if not arg.startswith("-"):
                continue  # the value of the flag before it
            flag = arg.split("=", 1)[0]
            if flag in OWN_SERVE_FLAGS:
                raise ValueError(f"{flag} is set by the operator; use {OWN_SERVE_FLAGS[flag]} instead")
            if flag not in SERVE_OPTIONS:
                close = difflib.get_close_matches(flag, sorted(SERVE_OPTIONS), n=3)
                raise ValueError(f"{flag} is not an option of vLLM {VLLM_VERSION}'s `vllm serve`"
                                 + (f" (similar: {', '.join(close)})" if close else ""))
        return args


class ColocatedSpec(SpecModel):
    """How colocated rollout servers (`rollout.placement: colocated`) and the trainer take turns
    on the same devices."""

    sleep_level: Literal[1, 2] = 2
    """The servers' sleep while the trainer trains (vLLM `POST /sleep?level=`): 2 discards
    their weights and KV cache (the trainer then pushes every weight before they generate
    again); 1 keeps a copy of their weights in host memory (host RAM of one model copy per
    server)."""
    offload_trainer: bool = True
    """Move the trainer's parameters and optimizer state to host memory while the servers
    generate (through the training engine), and back before the update."""
