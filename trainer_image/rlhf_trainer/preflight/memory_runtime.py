"""What a trainer process holds on its GPU besides the model, for the memory plan
(memory_plan.py): the CUDA context, the NCCL communicators it joins, and rank 0's
weight-sync buffers. The first two live outside torch's caching allocator (no
fragmentation margin applies to them, and `torch.cuda.max_memory_reserved` never shows
them); `make gpu-check` measures both on the GPU it runs on (docs/testing.md).

Where the numbers come from:
- CUDA context and cuBLAS workspaces: measured 0.80 GiB outside the caching allocator
  (the device's used memory minus `memory_reserved`) after our train step on an H200 with
  torch 2.11 and CUDA 13 (`make gpu-check`, 2026-11-26); the plan takes 0.85 GiB.
- One NCCL communicator of several GPUs: NCCL allocates its channel buffers
  (NCCL_BUFFSIZE, 4 MiB per channel, peer and protocol) and, on NVLink-switch (HGX)
  nodes, NVLS buffers; more channels to reach NVLink bandwidth means more memory. Reported:
  544 MiB (2 GPUs) and 688 MiB (3-4 GPUs) per communicator on 4 x A100 NVLink
  (NVIDIA/nccl#964), about 1.6 GB for one communicator after an all-reduce and about 6 GB
  for three (NVIDIA/nccl#864); NCCL's maintainer: linear in the channels, more on H100 than
  on A100, and every communicator pays again unless split with shared resources
  (NVIDIA/nccl#986). Measured here: 0.48 GiB for a one-GPU communicator on an H200 (NCCL
  2.28.9, `make gpu-check`), which has no peers to buffer for. The plan takes 1 GiB per
  communicator; `NCCL_NVLS_ENABLE=0` lowers it.
- Which communicators (parallel/parallelize.py, weight_sync/): with more than one
  process, the default world group (barriers, metrics) and FSDP's flattened `dp_shard_cp`
  group (a communicator of its own even when it spans every rank); the `tp` and `cp`
  groups when larger than one; on rank 0 of an RL job, the weight-sync communicator with the
  rollout servers. Rank 0 holds the most, so the plan counts its.
- Weight sync (weight_sync/sender.py, buckets.py): see `weight_sync_bytes`.
"""

from __future__ import annotations

from .memory_shapes import GIB

CUDA_CONTEXT_BYTES = int(0.85 * GIB)
"""CUDA context and cuBLAS workspaces of one process (see the module docstring)."""
NCCL_COMMUNICATOR_BYTES = 1 * GIB
"""GPU memory of one NCCL communicator of several GPUs (see the module docstring)."""
WEIGHT_SYNC_BUFFERS = 3
"""Pack buffers of one weight-sync round (sender.py: one broadcasting, one queued, one filling)."""


def nccl_communicators(world_size: int, tp: int, cp: int, *, weight_sync: bool) -> list[str]:
    """The NCCL communicators trainer rank 0 joins (see the module docstring)."""
    names = ["world", "FSDP (dp_shard_cp)"] if world_size > 1 else []
    names += ["tensor parallel"] * (tp > 1) + ["context parallel"] * (cp > 1)
    return names + ["weight sync (rank 0)"] * weight_sync


def weight_sync_bytes(bucket_bytes: int, largest_elements: int, wire_itemsize: int = 2) -> int:
    """Rank 0's working set during a weight-sync round, at its worst: the buffer ring's 3
    buffers (buckets.BufferRing), each grown to the largest bucket it held (a bucket closes
    once it EXCEEDS the bucket size, so at most the bucket size plus its closing tensor, the
    largest one at worst); as much again for the bucket being packed (`pack_buckets` keeps
    its tensors, cast to the wire dtype, alive until it copies them in); and the largest
    tensor gathered whole in fp32 (the gathering generator holds it while it is cast).
    Checked against the real packing code's allocations on the CPU for every position of
    the largest tensor in its bucket (tests/unit/test_memory_plan.py): at most 10 % above
    the worst."""
    closing = bucket_bytes + largest_elements * wire_itemsize
    return (WEIGHT_SYNC_BUFFERS + 1) * closing + 4 * largest_elements
