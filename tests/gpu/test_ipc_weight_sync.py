"""CUDA IPC weight transfer on a real GPU (rlhf_trainer/weight_sync/ipc.py): gpu-check's `ipc`
part (bench/gpu_check_ipc.py), as a test. A second process maps the buckets our trainer side
exports, as vLLM's ipc engine does (look up its GPU's UUID, set the device index,
`rebuild_cuda_tensor`, cut by `tensor_sizes`, clone), and gets every tensor bit for bit,
bucket after bucket from one reused buffer. tests/vllm/test_ipc_payload.py checks the same
bodies against vLLM's own parser on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_second_process_maps_every_bucket_of_one_reused_buffer():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_check_ipc import part_ipc

    result = part_ipc()
    assert result["status"] == "ok" and not result["mismatched"], result
    assert result["buckets"] >= 3, result
