"""CUDA IPC weight transfer on a real GPU (rlhf_trainer/weight_sync/ipc.py): a second
process maps the buckets our trainer side exports, as vLLM's ipc engine does (look up its
GPU's UUID, set the device index, `rebuild_cuda_tensor`, cut by `tensor_sizes`, clone),
and gets every tensor bit for bit, bucket after bucket from one reused buffer.
tests/vllm/test_ipc_payload.py checks the same bodies against vLLM's own parser on the CPU."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RECEIVER = textwrap.dedent("""
    import base64, json, pickle, sys, torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    sums = {}
    for line in sys.stdin:
        info = json.loads(line)
        args = list(pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))[uuid])
        args[6] = 0
        packed = rebuild_cuda_tensor(*args)[:sum(info["tensor_sizes"])]
        for name, shape, dtype, part in zip(info["names"], info["shapes"], info["dtype_names"],
                                            packed.split(info["tensor_sizes"])):
            t = part.view(getattr(torch, dtype)).view(shape).clone()
            sums[name] = [float(t.double().sum()), float(t.double().abs().max())]
        torch.cuda.synchronize()
        print("ok", flush=True)  # the sender may refill its buffer now
    print(json.dumps(sums), flush=True)
""")


def test_a_second_process_maps_every_bucket_of_one_reused_buffer():
    from rlhf_trainer.weight_sync import ipc
    from rlhf_trainer.weight_sync.buckets import BufferRing, bucket_ranges, checked_bytes, pack_buckets

    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    named = [(f"layer.{i}.weight", torch.randn(256, 64 + 8 * i, generator=g, device=device)) for i in range(8)]
    source = [(n, list(t.shape), t.dtype) for n, t in named]
    sync = ipc.IpcSync(torch.bfloat16, bucket_bytes=96 * 1024)
    wire = [(n, s, sync.wire(d)) for n, s, d in source]
    ranges = bucket_ranges([torch.Size(s).numel() * d.itemsize for _, s, d in wire], sync.bucket_bytes)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    uuid = ipc.gpu_uuid(device)
    buckets = pack_buckets(checked_bytes(source, (t for _, t in named), device, wire), sync.bucket_bytes,
                           BufferRing(device, count=1))
    for members, bucket in zip(ranges, buckets, strict=True):
        torch.cuda.synchronize()
        info = ipc.update_info(wire[members.start:members.stop], {uuid: ipc.export(bucket)})
        assert pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))[uuid]
        receiver.stdin.write(json.dumps(info) + "\n")
        receiver.stdin.flush()
        assert receiver.stdout.readline().strip() == "ok"
    receiver.stdin.close()
    sums = json.loads(receiver.stdout.readline())
    assert receiver.wait(60) == 0 and len(ranges) >= 3
    for name, t in named:
        b = t.to(torch.bfloat16).double()
        assert sums[name] == [float(b.sum()), float(b.abs().max())], name
