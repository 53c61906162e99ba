"""The NCCL transport with two GPUs: the real sender (trainer rank 0, cuda:0) pushes packed
buckets to a receiver process on cuda:1 that follows vLLM's receiver code path: it joins
from `init_info.nccl_unique_id_b64` (ncclCommInitRank at rank `rank_offset`, then the
one-element float32 sum all_reduce of PyNcclCommunicator's warm-up), takes the packed
settings from init_info, cuts buckets from update_info's metadata with the layout that
tests/protocol/ checks against vLLM's own consumer, receives each bucket with an NCCL
broadcast from rank 0, and loads the views. Bit-exact checksums on both sides.

The receiver (bench/gpu_check_receiver.py, the one `make gpu-check` uses) speaks the HTTP
routes over a plain http.server; it is a test stand-in, not vLLM (which cannot be installed
beside our torch). Skipped without two CUDA devices.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs"),
              pytest.mark.skipif(not os.environ.get("RLHF_VLLM_SOURCE"),
                                 reason="needs vLLM 0.33.0's source in RLHF_VLLM_SOURCE (its receiver)")]

RECEIVER = Path(__file__).resolve().parents[2] / "bench" / "gpu_check_receiver.py"
"""The receiver of `make gpu-check`'s pair part, on cuda:1, joining through vLLM's
PyNcclCommunicator (RLHF_VLLM_SOURCE is set), its weights in their own dtypes."""


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def receiver():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(RECEIVER), "--port", str(port), "--backend", "nccl", "--device",
                             "cuda:1", "--serving-dtype", ""])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "receiver did not start"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(30)


def test_packed_nccl_buckets_bit_exact_on_the_receiver_gpu(receiver):
    from rlhf_trainer.weight_sync import WeightSyncSender

    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {f"model.layers.{i}.w": torch.randn(257, 33 + i, device="cuda", generator=gen).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16] * 4)}
    tensors["lm_head.weight"] = torch.randn(3000, 64, device="cuda", generator=gen).to(torch.bfloat16)
    meta = [(n, list(t.shape), t.dtype) for n, t in tensors.items()]
    sender = WeightSyncSender([receiver], "127.0.0.1", 0, bucket_bytes=64 * 1024, timeout_s=120)
    try:
        sender.init()
        assert sender.backend == "nccl" and sender.world_size == 2
        for version in ("1", "2"):
            stats = sender.send(meta, iter(tensors.values()), weight_version=version)
            assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
            assert stats["buckets"] > 3
            got = httpx.get(receiver + "/checksums").json()
            assert got["checksums"] == {n: sha256(t) for n, t in tensors.items()}
            tensors = {n: t * 2 for n, t in tensors.items()}  # round 2: new values, same metadata
    finally:
        sender.close()
    assert json.dumps(got["calls"]).count("/update_weights") == 2
