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
    "--quantization": "rollout.vllm.quantization", "-q": "rollout.vllm.quantization",
    "--quantization-config": "rollout.vllm.quantization",
    "--nnodes": "rollout.nodesPerServer", "-n": "rollout.nodesPerServer", "--node-rank": "rollout.nodesPerServer",
    "-r": "rollout.nodesPerServer", "--master-addr": "rollout.nodesPerServer",
    "--master-port": "rollout.nodesPerServer", "--headless": "rollout.nodesPerServer",
}

QUANTIZATION_FLAG = {"fp8": "fp8_per_block", "fp8_per_block": "fp8_per_block", "fp8_per_tensor": "fp8_per_tensor",
                     "fp8_per_channel": "fp8_per_channel"}
"""`rollout.vllm.quantization` -> `vllm serve --quantization`: vLLM's online quantization (a
bf16 checkpoint quantized as it loads). vLLM's own `fp8` is for checkpoints already stored in
FP8 and refuses any other (tests/protocol checks this against its code), so our `fp8` is its
128x128-block scheme, the one DeepSeek-V3 and veRL's FP8 rollouts use."""


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
    quantization: Literal["fp8", "fp8_per_block", "fp8_per_tensor", "fp8_per_channel"] | None = None
    """FP8 rollouts: the servers quantize the policy's weights to FP8 as they load them and again
    at every weight push (vLLM's online quantization, `--quantization`; its layerwise reload
    re-quantizes pushed weights), halving their weight memory and speeding up generation; the
    trainer still trains and pushes in its own dtype. `fp8` is `fp8_per_block` (128x128 blocks,
    a scale each); `fp8_per_channel` a scale per output channel; `fp8_per_tensor` one per
    weight. Linear layers only (embeddings and the LM head stay in model.dtype). Needs GPUs
    with FP8 (compute capability 8.9 and above: L4, L40S, H100, H200, B200; on A100 vLLM
    falls back to weight-only FP8). The rollout log-probs then differ more from the trainer's:
    set algorithm.rolloutCorrection (e.g. token-mask) with it."""
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
