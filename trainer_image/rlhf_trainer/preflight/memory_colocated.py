"""The memory plan of a colocated job (`rollout.placement: colocated`): the trainer and a
rollout server's worker on the same GPU, taking turns (rl/colocation.py). Per GPU, at the
trainer's rank 0 (the most loaded: it packs the weight-sync buckets), three phases:

- train: the servers asleep (level 1 keeps their weights in host memory, level 2 drops them;
  either way the GPU keeps only the worker's CUDA context) and the trainer at its own peak
  (memory_plan.py `plan`);
- sync: the servers' weights awake (not their KV cache), the trainer's persistent state and
  its weight-sync buffers (CUDA IPC: one bucket buffer and the bucket being packed,
  weight_sync/ipc.py);
- generate: the servers' weights, their KV cache (`rollout.vllm.kvCacheMemoryBytes`, in
  bytes per GPU, never a fraction of what is free: the trainer's state is on the same GPU)
  and their working memory, beside the trainer's persistent state, or beside nothing but its
  CUDA context when `rollout.colocated.offloadTrainer` moves it to host memory through the
  training engine.

Server figures: the weights in the serving dtype (2 bytes per parameter on GPUs: bf16)
divided by `rollout.tensorParallelSize`, or with `rollout.vllm.quantization` (FP8 rollouts)
the layers' weights at 1 byte, the embeddings, LM head and norms still at 2, and one layer at
2 bytes more for vLLM's layerwise (re)load, which quantizes each layer once its bf16 weights
have arrived (server_weight_bytes); a CUDA context like the trainer's; and
SERVER_WORKING_BYTES for what a generating worker allocates beyond weights and KV cache
(sampler, activations of a batch, CUDA graphs unless enforceEager), which is NOT measured
here: `make gpu-check` has no vLLM to measure it with.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..rl.placement import colocated_spec
from .memory_plan import FRAGMENTATION, GIB, MemoryPlan, model_shape
from .memory_runtime import CUDA_CONTEXT_BYTES

SERVER_WORKING_BYTES = int(1.5 * GIB)
"""A generating vLLM worker's memory beyond its weights and KV cache (not measured: see above)."""
IPC_BUFFERS = 1
"""weight_sync/ipc.py packs into one reused buffer (the servers copy each bucket out)."""


@dataclass(frozen=True)
class Phase:
    name: str
    bytes: int
    note: str


def server_weight_bytes(shape, quantization: str | None, tp: int) -> int:
    """A rollout server's weights per GPU (module docstring). FP8 scales (one float per
    128x128 block, output channel or weight) are under 0.1 % of the weights and left out."""
    if quantization is None:
        return int(2 * shape.total(head=True) / tp)
    layers = shape.num_layers * shape.layer  # quantized: 1 byte a weight
    kept = shape.embed + shape.head + shape.norm  # not quantized: the serving dtype
    return int((layers + 2 * kept + 2 * shape.layer) / tp)


def colocated_phases(config, model_config: dict, trainer: MemoryPlan) -> list[Phase]:
    """The three phases' per-GPU bytes (module docstring) of a colocated job on CUDA, from
    the trainer's own plan; [] when the job is not colocated or sets no KV cache size."""
    colocated = colocated_spec(config)
    kv = config.sampling.kv_cache_memory_bytes
    if colocated is None or kv is None:
        return []
    from ..weight_sync.buckets import DEFAULT_BUCKET_BYTES

    tp = config.sampling.tensor_parallel_size
    s = model_shape(model_config)
    quantization = config.sampling.quantization
    server_weights = server_weight_bytes(s, quantization, tp)
    persistent = sum(t.bytes for t in trainer.terms if t.phase == "persistent")
    fixed = trainer.fixed
    closing = DEFAULT_BUCKET_BYTES + 2 * s.largest  # a bucket closes once it exceeds the size (bf16 on the wire)
    ipc = (IPC_BUFFERS + 1) * closing + 4 * s.largest  # the buffer, the bucket being packed, one tensor in fp32
    resident = 0 if colocated.offload_trainer else persistent
    server_ctx = CUDA_CONTEXT_BYTES
    return [
        Phase("train", trainer.total + server_ctx, f"the trainer's peak ({trainer.peak_phase}); servers asleep "
              f"(level {colocated.sleep_level}: only their CUDA context)"),
        Phase("sync", int(fixed + (1 + FRAGMENTATION) * (persistent + ipc)) + server_weights + server_ctx,
              "the trainer's state and its IPC buffers; the servers' weights awake, not their KV cache"),
        Phase("generate", int(fixed + (1 + FRAGMENTATION) * resident) + server_weights + kv + server_ctx
              + SERVER_WORKING_BYTES,
              ("the trainer offloaded to host memory" if colocated.offload_trainer else "the trainer's state resident")
              + f"; server weights {server_weights / GIB:.1f} GiB ({quantization + ', ' if quantization else ''}/ tp {tp}), KV cache {kv / GIB:.1f} GiB, "
              f"working memory {SERVER_WORKING_BYTES / GIB:.1f} GiB (not measured)"),
    ]


def colocated_problem(config, phases: list[Phase], gpu_bytes: int) -> str:
    """The preflight problem when a phase does not fit ("" when all do)."""
    over = [p for p in phases if p.bytes > gpu_bytes]
    if not over:
        return ""
    worst = max(over, key=lambda p: p.bytes)
    fixes = {"train": "the trainer's own fixes (trainer.maxTokensPerMicroBatch, activation checkpointing, more GPUs)",
             "sync": "more GPUs (trainer.nprocPerNode) or a larger rollout.tensorParallelSize",
             "generate": "a smaller rollout.vllm.kvCacheMemoryBytes"
             + ("" if colocated_spec(config).offload_trainer else ", or rollout.colocated.offloadTrainer: true")}
    return (f"spec.rollout.placement: colocated, the {worst.name} phase needs {worst.bytes / GIB:.1f} GiB per GPU of "
            f"{gpu_bytes / GIB:.1f} ({worst.note}): " + "; ".join(fixes[p.name] for p in over)
            + " (rlhfctl plan job.yaml shows the phases)")


@dataclass(frozen=True)
class MemoryVerdict:
    """A job's whole memory answer: the trainer's plan, a colocated job's phases, and the
    problem that refuses it ("" when it fits). `rlhfctl plan` prints it and the trainer's
    preflight returns its problem: one answer for both."""

    plan: MemoryPlan
    phases: list[Phase]
    problem: str

    @property
    def peak(self) -> int:
        return max([self.plan.total, *(p.bytes for p in self.phases)])


def memory_verdict(config, model_config: dict, world_size: int, gpu_bytes: int,
                   reward_model_config: dict | None = None) -> MemoryVerdict:
    """The plan of `config` (memory_plan.py `plan`, whichever engine the job trains on) and
    its colocated phases; raises what `plan` raises for a model it cannot build."""
    from .memory_plan import plan

    result = plan(config, model_config, world_size, gpu_bytes, reward_model_config=reward_model_config)
    if not result.fits:
        return MemoryVerdict(result, [], result.message())
    phases = colocated_phases(config, model_config, result)
    return MemoryVerdict(result, phases, colocated_problem(config, phases, gpu_bytes))
