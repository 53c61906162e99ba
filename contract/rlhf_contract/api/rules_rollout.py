"""Rules of where the rollout servers run (`rollout.placement`), and of what the operator can
build (CLUSTER_RULES: the CRD's CEL and the operator's builders, not what a job means; local
mode runs these jobs)."""

from __future__ import annotations

from .rule import Rule

COLOCATED_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.maxStaleness",
        cel="self.rollout.placement != 'colocated' || self.rollout.maxStaleness == 0",
        message="must be 0 with rollout.placement colocated: colocated servers sleep while the trainer "
        "trains, so nothing is generated ahead; use placement separate to overlap generation and training",
        check=lambda s: s.rollout.placement != "colocated" or s.rollout.max_staleness == 0,
        detail=lambda s: f"got {s.rollout.max_staleness}",
    ),
    Rule(
        field_path="rollout.vllm.kvCacheMemoryBytes",
        cel="self.rollout.placement != 'colocated' || self.rollout.engine != 'vllm' || "
        "(has(self.rollout.vllm) && has(self.rollout.vllm.kvCacheMemoryBytes))",
        message="is required with rollout.placement colocated and engine vllm: the KV cache is set in bytes, "
        "not as what gpuMemoryUtilization leaves, because the trainer's state shares the GPU",
        check=lambda s: (s.rollout.placement != "colocated" or s.rollout.engine != "vllm"
                         or s.rollout.vllm.kv_cache_memory_bytes is not None),
    ),
)

CLUSTER_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.placement",
        cel="self.rollout.placement != 'colocated'",
        message="colocated runs in local mode only (rlhfctl run) in this release: on a cluster the servers "
        "would need the trainer pods' own GPUs and CUDA IPC weight transfer, which the operator does not "
        "build yet; use placement separate",
        check=lambda s: s.rollout.placement != "colocated",
    ),
)
"""Rules of what the operator can build (the CRD's CEL and the operator's builders), not of
what a job means: local mode runs these jobs."""
