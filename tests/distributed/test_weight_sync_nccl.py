"""The NCCL transport with two GPUs: the real sender (trainer rank 0, cuda:0) pushes packed
buckets to a receiver process on cuda:1 that follows vLLM's receiver code path: it joins
from `init_info.nccl_unique_id_b64` (ncclCommInitRank at rank `rank_offset`, then the
one-element float32 sum all_reduce of PyNcclCommunicator's warm-up), takes the packed
settings from init_info, cuts buckets from update_info's metadata with the layout that
tests/protocol/ checks against vLLM's own consumer, receives each bucket with an NCCL
broadcast from rank 0, and loads the views. Bit-exact checksums on both sides.

The receiver speaks the HTTP routes over a plain http.server; it is a test stand-in, not
vLLM (which cannot be installed beside our torch). Skipped without two CUDA devices.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch
from helpers import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs"),
              pytest.mark.skipif(not os.environ.get("RLHF_VLLM_SOURCE"),
                                 reason="needs vLLM 0.33.0's source in RLHF_VLLM_SOURCE (its receiver)")]

RECEIVER = textwrap.dedent('''
    import base64, hashlib, http.server, json, math, os, sys, threading
    import torch
    from rlhf_trainer.weight_sync.buckets import bucket_ranges
    sys.path.insert(0, os.environ["RLHF_VLLM_SOURCE"])
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    port = int(sys.argv[1])
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    state = {"comm": None, "init": None, "meta": None, "checksums": {}, "active": False, "calls": []}

    def init(info):
        uid = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
        assert len(uid) == 128 and "master_address" not in info
        # vLLM's worker: ncclCommInitRank at rank_offset, then its one-element all_reduce warm-up
        comm = PyNcclCommunicator.from_unique_id_bytes(uid, info["rank_offset"], info["world_size"], device)
        torch.cuda.synchronize(device)
        state["comm"], state["init"] = comm, info

    def update(info):
        assert state["active"], "start_weight_update must be called before update_weights."
        assert set(info) == {"names", "dtype_names", "shapes"}
        if info["names"]:
            state["meta"] = info
        meta = state["meta"]
        dtypes = [getattr(torch, d) for d in meta["dtype_names"]]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(meta["shapes"], dtypes)]
        assert state["init"]["packed"] is True
        for bucket in bucket_ranges(sizes, state["init"]["packed_buffer_size_bytes"]):
            buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=device)
            state["comm"].broadcast(buf, src=0)
            for i, part in zip(bucket, buf.split([sizes[i] for i in bucket])):
                t = part.contiguous().view(dtypes[i]).view(meta["shapes"][i]).cpu()
                state["checksums"][meta["names"][i]] = hashlib.sha256(
                    t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        torch.cuda.synchronize(device)

    class Handler(http.server.BaseHTTPRequestHandler):
        def reply(self, obj, code=200):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/health":
                return self.reply({})
            if path == "/version":
                return self.reply({"version": "0.33.0"})  # the handshake's first question
            if path == "/get_world_size":
                return self.reply({"world_size": 1})
            if path == "/server_info":
                return self.reply({"vllm_config": {"weight_transfer_config": {"backend": "nccl"}}})
            if path == "/checksums":
                return self.reply({"checksums": state["checksums"], "calls": state["calls"]})
            self.reply({}, 404)

        def do_POST(self):
            path = self.path.split("?")[0]
            state["calls"].append(path)
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            try:
                if path == "/init_weight_transfer_engine":
                    init(body["init_info"])
                elif path == "/start_weight_update":
                    assert not state["active"]
                    state["active"] = True
                elif path == "/update_weights":
                    update(body["update_info"])
                elif path == "/finish_weight_update":
                    assert state["active"]
                    state["active"] = False
                elif path == "/reset_prefix_cache":
                    return self.reply({"success": True})
                elif path in ("/pause", "/resume", "/shutdown_weight_transfer_engine"):
                    pass
                else:
                    return self.reply({}, 404)
            except Exception as exc:
                state["active"] = False
                return self.reply({"error": repr(exc)}, 500)
            self.reply({"message": "ok"})

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')




def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def receiver():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
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
