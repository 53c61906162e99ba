"""The memory of a GPU named by the node label a job's pods select on
(`spec.pod.nodeSelector["nvidia.com/gpu.product"]`, the label NVIDIA's GPU feature
discovery puts on each node: the CUDA device name with spaces as dashes), so `rlhfctl plan`
can plan a cluster job on a machine without that GPU.

The figures are `nvidia-smi --query-gpu=memory.total` of each product in MiB (what
`detect_gpu_bytes` reads on the node itself). Only products listed here are known; MIG
slices (`...-MIG-1g.10gb`) are not: give `--gpu-memory-gib` for those."""

from __future__ import annotations

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

GPU_MEMORY_MIB: dict[str, int] = {
    "NVIDIA-H200": 143771,
    "NVIDIA-H100-80GB-HBM3": 81559,
    "NVIDIA-H100-PCIe": 81559,
    "NVIDIA-H100-NVL": 95830,
    "NVIDIA-A100-SXM4-80GB": 81920,
    "NVIDIA-A100-80GB-PCIe": 81920,
    "NVIDIA-A100-SXM4-40GB": 40960,
    "NVIDIA-A100-PCIE-40GB": 40960,
    "NVIDIA-L40S": 46068,
    "NVIDIA-A10G": 23028,
    "NVIDIA-L4": 23034,
}

SHARED_SUFFIX = "-SHARED"
"""GPU feature discovery appends it to the product when the GPU is time-sliced (same memory)."""


def selected_gpu_bytes(node_selector: dict[str, str] | None) -> tuple[int, str] | None:
    """(bytes of one GPU, the product) for the product a node selector names, or None when
    it names none or one not listed."""
    product = (node_selector or {}).get(GPU_PRODUCT_LABEL)
    if not product:
        return None
    mib = GPU_MEMORY_MIB.get(product.removesuffix(SHARED_SUFFIX))
    return None if mib is None else (mib << 20, product)
