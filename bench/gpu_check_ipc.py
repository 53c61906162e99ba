"""The `ipc` part of `make gpu-check`: CUDA IPC weight transfer (rlhf_trainer/weight_sync/ipc.py)
to a second process on the same GPU, as colocated vLLM servers take weights: the receiver
looks up its GPU's UUID in each bucket's handles, sets the device index, maps the buffer
(`rebuild_cuda_tensor`), cuts it by `tensor_sizes` and clones each tensor, as vLLM's packed
IPC consumer does; bucket after bucket from one reused buffer. Bit-exactness (the sha256 of
every tensor's bytes, on both sides: tensor_digest.py) and GB/s."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from tensor_digest import sha256 as tensor_sha256

BENCH = Path(__file__).resolve().parent



RECEIVER = textwrap.dedent("""
    import base64, json, pickle, sys, torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    sys.path.insert(0, sys.argv[1])
    from tensor_digest import sha256 as tensor_sha256
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    torch.zeros(1, device="cuda")
    print("ready", flush=True)
    sums = {}
    for line in sys.stdin:
        info = json.loads(line)
        args = list(pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))[uuid])
        args[6] = 0
        packed = rebuild_cuda_tensor(*args)[:sum(info["tensor_sizes"])]
        for name, shape, dtype, part in zip(info["names"], info["shapes"], info["dtype_names"],
                                            packed.split(info["tensor_sizes"])):
            t = part.view(getattr(torch, dtype)).view(shape).clone()
            sums[name] = tensor_sha256(t)
        torch.cuda.synchronize()
        print("ok", flush=True)
    print(json.dumps(sums), flush=True)
""")


def part_ipc() -> dict:
    from rlhf_trainer.weight_sync import ipc
    from rlhf_trainer.weight_sync.buckets import BufferRing, bucket_ranges, checked_bytes, pack_buckets

    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(0)
    named = [(f"layers.{i}.weight", torch.randn(4096, 4096 + 64 * i, device=device, generator=gen)) for i in range(16)]
    source = [(n, list(t.shape), t.dtype) for n, t in named]
    sync = ipc.IpcSync(torch.bfloat16, bucket_bytes=256 << 20)
    wire = [(n, s, sync.wire(d)) for n, s, d in source]
    ranges = bucket_ranges([torch.Size(s).numel() * d.itemsize for _, s, d in wire], sync.bucket_bytes)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(BENCH)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline().strip() == "ready"
    uuid = ipc.gpu_uuid(device)
    start = time.perf_counter()
    nbytes = 0
    buckets = pack_buckets(checked_bytes(source, (t for _, t in named), device, wire), sync.bucket_bytes,
                           BufferRing(device, count=1))
    for members, bucket in zip(ranges, buckets, strict=True):
        torch.cuda.synchronize()
        receiver.stdin.write(json.dumps(ipc.update_info(wire[members.start:members.stop],
                                                        {uuid: ipc.export(bucket)})) + "\n")
        receiver.stdin.flush()
        if receiver.stdout.readline().strip() != "ok":
            raise RuntimeError(f"the receiver failed: exit {receiver.poll()}")
        nbytes += bucket.numel()
    seconds = time.perf_counter() - start
    receiver.stdin.close()
    sums = json.loads(receiver.stdout.readline())
    receiver.wait(60)
    mismatched = [n for n, t in named if sums.get(n) != tensor_sha256(t.to(torch.bfloat16))]
    out = {"buckets": len(ranges), "gib": round(nbytes / 2**30, 3), "seconds": round(seconds, 3),
           "gb_per_s": round(nbytes / seconds / 1e9, 1), "mismatched": mismatched}
    out["status"] = "ok" if not mismatched else "failed"
    out["summary"] = (f"{len(ranges)} bf16 buckets ({out['gib']} GiB) mapped by a second process and copied out, "
                      f"{out['gb_per_s']} GB/s including packing; "
                      + (f"the sha256 of all {len(named)} tensors equal on both sides" if not mismatched else f"MISMATCHED: {mismatched}"))
    return out
