"""A rollout server's weight-transfer side, as a process of its own: the receiver that
`make gpu-check`'s `pair` and `failures` parts (bench/gpu_check_pair.py), their CPU tests
(tests/unit/test_gpu_check_pair.py) and tests/distributed/test_weight_sync_nccl.py push
weights to. It is a stand-in for a vLLM server (which cannot be installed beside our torch),
not vLLM; it follows vLLM's receiver code path:

- GET /version, /server_info, /get_world_size answer the trainer's start-up handshake
  (rollout/servers.py): vLLM 0.33.0, `weight_transfer_config.backend` ("nccl" or "gloo"),
  `model_config.dtype` bfloat16 (`--serving-dtype`), one worker, and on NCCL the trainer's own NCCL release;
- POST /init_weight_transfer_engine joins the group from `init_info` at `rank_offset`: on
  NCCL from `nccl_unique_id_b64` (ncclCommInitRank, then the one-element float32 sum
  all_reduce of vLLM's PyNcclCommunicator warm-up), through vLLM's own PyNcclCommunicator
  when `RLHF_VLLM_SOURCE` names its source (`vllm_communicator`), else through our libnccl binding
  (rlhf_trainer.weight_sync.nccl); on gloo over the TCPStore at master_address:master_port,
  as the CPU engine does (inference_image cpu_engine/weights.py);
- POST /update_weights cuts the packed buckets from the round's metadata (names,
  dtype_names, shapes; empty lists reuse the last round's) with the packed settings of
  init_info (`rlhf_trainer.weight_sync.buckets.bucket_ranges`, the layout tests/protocol/
  checks against vLLM's consumer), receives each by a broadcast from rank 0 and keeps the
  tensors; /pause, /resume, /start_weight_update, /finish_weight_update,
  /reset_prefix_cache ({"success": true}), /shutdown_weight_transfer_engine as vLLM;
- GET /checksums: the sha256 of every tensor received (its bytes), the calls seen, and which
  communicator received (vLLM's, or ours and why);
  GET /progress: buckets received, and whether the receiver holds (below).

Faults, for the failure cases: `--hold-after N` stops taking buckets after the N-th of a
round (the trainer's broadcast of the next one then waits on this process, mid-transfer:
the harness kills or stops it there); `--never-join` takes /init_weight_transfer_engine
but never joins the group (the call answers only at shutdown).

    python bench/gpu_check_receiver.py --port 8001 --backend nccl --device cuda:0
"""

from __future__ import annotations

import argparse
import base64
import datetime
import http.server
import json
import math
import os
import sys
import threading
import time

import torch
from tensor_digest import sha256  # the same on the sender's side


def _weight_sync_modules():
    """rlhf_trainer.weight_sync's `nccl` and `buckets` modules, without the package's
    __init__ (which imports the whole sender and torch.distributed.checkpoint: 1.5 s of CPU
    per receiver, and the CPU tests start six at once)."""
    import importlib.util
    import types

    name = "rlhf_trainer.weight_sync"
    if name not in sys.modules:
        spec = importlib.util.find_spec("rlhf_trainer")
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(p, "weight_sync") for p in spec.submodule_search_locations]
        sys.modules[name] = package
    import rlhf_trainer.weight_sync.buckets as buckets
    import rlhf_trainer.weight_sync.nccl as nccl

    return nccl, buckets


nccl, _buckets = _weight_sync_modules()
bucket_ranges = _buckets.bucket_ranges

VLLM_VERSION = "0.33.0"




class NcclJoin:
    """Rank `rank` of the trainer's NCCL group on `device`, through our libnccl binding."""

    kind = "our libnccl binding"

    def __init__(self, uid: bytes, rank: int, world_size: int, device: torch.device):
        self.device, self.lib = device, nccl.load()
        with torch.cuda.device(device):
            self.comm = nccl.Communicator(self.lib, self.lib.comm_init_rank(world_size, uid, rank))
            warmup = torch.zeros(1, dtype=torch.float32, device=device)  # PyNcclCommunicator's warm-up
            self._run("ncclAllReduce", lambda h, s: self.lib.all_reduce_sum(warmup.data_ptr(), 1, "float32", h, s))
            torch.cuda.synchronize(device)

    def _run(self, call, fn) -> None:
        with self.comm.use(call) as handle:
            fn(handle, torch.cuda.current_stream(self.device).cuda_stream)

    def broadcast(self, buf: torch.Tensor) -> None:
        self._run("ncclBroadcast", lambda h, s: self.lib.broadcast(buf.data_ptr(), buf.numel(), "uint8", 0, h, s))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.comm.abort()


VLLM_SOURCE_ENV = "RLHF_VLLM_SOURCE"
"""A directory or zip holding the pinned vLLM's Python package (`make gpu-wheels` puts
`vllm-<version>-py.zip`, the .py files of its wheel, in .gpu/): its PyNcclCommunicator then
receives, not our binding."""
COMPILED_OPS = ("vllm._C_stable_libtorch",)
"""The compiled extensions vLLM's CUDA platform imports at its top (platforms/cuda.py: custom
ops that register themselves). The receiver uses none of them, and a zip of .py files has
none: each is stood in by an empty module so the platform, and the communicator, import."""


def vllm_communicator(source: str | None = None):
    """vLLM's own PyNcclCommunicator, from `source` (or the vLLM this Python has), and vLLM's
    version. Raises ImportError with vLLM's own message when its code cannot be imported."""
    import importlib
    import types

    if source and source not in sys.path:
        sys.path.insert(0, source)
    for name in COMPILED_OPS:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)  # not loadable here: an empty stand-in
    import vllm
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

    return PyNcclCommunicator, getattr(vllm, "__version__", "unknown")


class VllmJoin:
    """The same through vLLM's own PyNcclCommunicator (`vllm_communicator`)."""

    def __init__(self, uid: bytes, rank: int, world_size: int, device: torch.device):
        cls, version = vllm_communicator(os.environ.get(VLLM_SOURCE_ENV))
        self.kind = f"vLLM {version} PyNcclCommunicator"
        self.device = device  # from_unique_id_bytes runs the warm-up all_reduce, as vLLM's workers do
        self.comm = cls.from_unique_id_bytes(uid, rank, world_size, device)
        torch.cuda.synchronize(device)

    def broadcast(self, buf: torch.Tensor) -> None:
        self.comm.broadcast(buf, src=0)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass


class GlooJoin:
    """Rank `rank` of the trainer's gloo group, as the CPU engine joins it."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)

    def broadcast(self, buf: torch.Tensor) -> None:
        self.pg.broadcast(buf, 0).wait()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self.pg = self.store = None


class Receiver:
    def __init__(self, backend: str, device: torch.device, *, hold_after: int | None = None, never_join: bool = False,
                 timeout_s: float = 600.0, serving_dtype: str = "torch.bfloat16"):
        self.backend, self.device, self.timeout_s, self.serving_dtype = backend, device, timeout_s, serving_dtype
        self.hold_after, self.never_join = hold_after, never_join
        self.join = self.init_info = self.meta = self.join_error = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.active, self.holding, self.buckets = False, False, 0
        self.calls: list[str] = []
        self.shutdown = threading.Event()

    def server_info(self) -> dict:
        info: dict = {"vllm_config": {"weight_transfer_config": {"backend": self.backend}}}
        if self.serving_dtype:  # the sender casts every floating-point tensor to it
            info["vllm_config"]["model_config"] = {"dtype": self.serving_dtype}
        if self.backend == "nccl":  # the trainer compares its NCCL release with the server's pip list
            info["system_env"] = {"pip_packages": "nvidia-nccl-cu13==" + ".".join(map(str, nccl.load().version()))}
        return info

    def init(self, info: dict) -> None:
        self.init_info = info
        assert info["packed"] is True and info["packed_buffer_size_bytes"] > 0
        if self.never_join:
            self.shutdown.wait()  # took the call, never joins
            return
        rank, world = info["rank_offset"], info["world_size"]
        if self.backend == "nccl":
            uid = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
            assert len(uid) == 128 and "master_address" not in info
            self.join = None
            if os.environ.get(VLLM_SOURCE_ENV):
                try:
                    self.join = VllmJoin(uid, rank, world, self.device)
                except ImportError as exc:  # vLLM's code did not import here: said in the report
                    self.join_error = f"vLLM's PyNcclCommunicator did not import: {exc!r}"[:500]
            if self.join is None:
                self.join = NcclJoin(uid, rank, world, self.device)
        else:
            self.join = GlooJoin(info["master_address"], info["master_port"], rank, world, self.timeout_s)

    def update(self, info: dict) -> None:
        assert self.active, "start_weight_update must be called before update_weights."
        assert set(info) == {"names", "dtype_names", "shapes"}
        if info["names"]:
            self.meta = info
        names, shapes = self.meta["names"], self.meta["shapes"]
        dtypes = [getattr(torch, d) for d in self.meta["dtype_names"]]
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        for n, bucket in enumerate(bucket_ranges(sizes, self.init_info["packed_buffer_size_bytes"]), 1):
            buf = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8, device=self.device)
            self.join.broadcast(buf)
            for i, part in zip(bucket, buf.split([sizes[i] for i in bucket])):
                self.tensors[names[i]] = part.view(dtypes[i]).view(shapes[i])
            self.buckets += 1
            if self.hold_after is not None and n >= self.hold_after:
                self.join.synchronize()  # the N-th bucket is in; the next one waits on this process
                self.holding = True
                while True:
                    time.sleep(1)
        self.join.synchronize()

    def checksums(self) -> dict[str, str]:
        return {name: sha256(t) for name, t in self.tensors.items()}

    def close(self) -> None:
        self.shutdown.set()
        if self.join is not None:
            self.join.close()
            self.join = None


def handler(receiver: Receiver) -> type[http.server.BaseHTTPRequestHandler]:
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
            answers = {"/health": lambda: {}, "/version": lambda: {"version": VLLM_VERSION},
                       "/get_world_size": lambda: {"world_size": 1}, "/server_info": receiver.server_info,
                       "/checksums": lambda: {"checksums": receiver.checksums(), "calls": receiver.calls,
                                              "receiver": getattr(receiver.join, "kind", "gloo"),
                                              "receiver_error": receiver.join_error},
                       "/progress": lambda: {"buckets": receiver.buckets, "holding": receiver.holding}}
            if path not in answers:
                return self.reply({}, 404)
            self.reply(answers[path]())

        def do_POST(self):
            path = self.path.split("?")[0]
            receiver.calls.append(path)
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            try:
                if path == "/init_weight_transfer_engine":
                    receiver.init(body["init_info"])
                elif path == "/start_weight_update":
                    assert not receiver.active, "a weight update is already active"
                    receiver.active = True
                elif path == "/update_weights":
                    receiver.update(body["update_info"])
                elif path == "/finish_weight_update":
                    assert receiver.active
                    receiver.active = False
                elif path == "/reset_prefix_cache":
                    return self.reply({"success": True})
                elif path == "/shutdown_weight_transfer_engine":
                    receiver.close()
                elif path not in ("/pause", "/resume"):
                    return self.reply({}, 404)
            except Exception as exc:  # noqa: BLE001  (answered as vLLM answers a failed call)
                receiver.active = False
                return self.reply({"error": repr(exc)}, 500)
            self.reply({"message": "ok"})

        def log_message(self, *args):
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--hold-after", type=int, default=None, help="stop taking buckets after the N-th")
    parser.add_argument("--never-join", action="store_true", help="take the init call, never join the group")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the gloo group's timeout")
    parser.add_argument("--serving-dtype", default="torch.bfloat16",
                        help="model_config.dtype in /server_info ('' for none: tensors travel in their own dtypes)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    receiver = Receiver(args.backend, device, hold_after=args.hold_after, never_join=args.never_join,
                        timeout_s=args.timeout_s, serving_dtype=args.serving_dtype)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler(receiver))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
