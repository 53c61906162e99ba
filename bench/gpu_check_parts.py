"""The parts of `make gpu-check` (bench/gpu_check.py runs each in a process of its own).

Each part returns a dict: `summary` (one line for the report's table), `tables` (named
lists of rows, each a dict), and whatever else it measured. A part needs CUDA."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
GIB = 2**30
QWEN2_SHAPES = {
    "0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
    "1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                 tie_word_embeddings=True, rms_norm_eps=1e-6),
}
KEYWORDS = frozenset({"is_causal", "window_size", "scale", "enable_gqa"})
"""The varlen_attn keywords packed attention feature-detects."""


def gib(n: float) -> float:
    return round(n / GIB, 3)


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_world() -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)


# ---- 1. NCCL ---------------------------------------------------------------------------

class _Routes(BaseHTTPRequestHandler):
    """A rollout server with no workers (world size 0): the sender's group is rank 0 alone."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps({"success": True} if self.path.startswith("/reset_prefix_cache") else {}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def part_nccl() -> dict:
    from rlhf_trainer.rollout.servers import ServerInfo
    from rlhf_trainer.weight_sync import NcclTransport, WeightSyncSender, nccl
    from rlhf_trainer.weight_sync.buckets import BufferRing, as_bytes, pack_buckets

    lib = nccl.load()
    theirs = torch.cuda.nccl.version()
    out: dict = {"library": lib.path, "nccl": ".".join(map(str, lib.version())),
                 "torch_nccl": str(theirs) if isinstance(theirs, int) else ".".join(map(str, theirs[:3]))}
    torch.zeros(1, device="cuda")  # the CUDA context first, so the communicator's memory is its own
    used, reserved = device_used(), torch.cuda.memory_reserved()
    start = time.perf_counter()
    transport = NcclTransport(1)
    transport.connect()
    out["connect_seconds"] = round(time.perf_counter() - start, 3)
    out["communicator_gib_world1"] = gib(device_used() - used - (torch.cuda.memory_reserved() - reserved))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(4096, 4096 + 64 * i, device="cuda", generator=gen).to(torch.bfloat16) for i in range(16)]
    before = [t.clone() for t in tensors]
    buckets = list(pack_buckets((as_bytes(t, "cuda") for t in tensors), 64 << 20, BufferRing("cuda", 3)))
    transport.use_stream(torch.cuda.current_stream())
    for bucket in buckets:  # rank 0 alone: NCCL makes an in-place broadcast a no-op, so no rate is
        transport.broadcast(bucket)  # measured here (the `pair` part measures transfers between processes)
        transport.check()
    transport.synchronize()
    nbytes = sum(b.numel() for b in buckets)
    out["buckets"] = {"count": len(buckets), "gib": gib(nbytes),
                      "unchanged_at_root": all(torch.equal(a, b) for a, b in zip(tensors, before))}
    with transport.comm.use("ncclCommGetAsyncError") as handle:
        out["async_error_when_healthy"] = lib.async_error(handle)
    out["abort"] = _abort_while_waiting(transport)
    out["sender_round"] = _sender_round(ServerInfo, WeightSyncSender, lib)
    ok = out["buckets"]["unchanged_at_root"] and out["abort"]["ok"] and out["sender_round"]["ok"]
    out["status"] = "ok" if ok else "failed"
    out["summary"] = (f"NCCL {out['nccl']} (torch's {out['torch_nccl']}), connect {out['connect_seconds']} s, "
                      f"world-1 communicator {out['communicator_gib_world1']} GiB, {len(buckets)} bf16 buckets "
                      f"broadcast by rank 0 alone (no transfer, no rate), abort while waiting: {out['abort']}, "
                      f"sender round: {out['sender_round']}")
    return out


def _abort_while_waiting(transport) -> dict:
    """close() from another thread while this one polls in synchronize(): the wait ends with
    CommunicatorClosed, no crash, and every later call is refused."""
    from rlhf_trainer.weight_sync import nccl

    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    for _ in range(8):
        transport.broadcast(big)
    outcome: dict = {}

    def wait():
        try:
            transport.synchronize()
            outcome["wait"] = "completed before the abort"
        except nccl.CommunicatorClosed:
            outcome["wait"] = "ended by the abort"
        except Exception as exc:  # noqa: BLE001
            outcome["wait"] = repr(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    start = time.perf_counter()
    transport.close()
    thread.join(30)
    torch.cuda.synchronize()
    outcome["close_seconds"] = round(time.perf_counter() - start, 3)
    try:
        transport.check()
        outcome["after"] = "a call reached the aborted communicator"
    except nccl.CommunicatorClosed:
        outcome["after"] = "refused"
    outcome["ok"] = not thread.is_alive() and outcome["after"] == "refused" and outcome["wait"] in (
        "ended by the abort", "completed before the abort")
    return outcome


def _sender_round(ServerInfo, WeightSyncSender, lib) -> dict:
    """A whole round of the real sender (fp32 masters sent as bf16, 64 MiB buckets) over a
    world-size-1 group: init, two rounds, close."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Routes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    sender = WeightSyncSender([url], "127.0.0.1", 0, bucket_bytes=64 << 20, timeout_s=120)
    try:
        sender.init([ServerInfo(url, "0.33.0", "nccl", 0, dtype="torch.bfloat16", nccl=lib.version())])
        weights = {f"model.layers.{i}.mlp.weight": torch.randn(1536, 8960, device="cuda") for i in range(8)}
        meta = [(n, list(t.shape), t.dtype) for n, t in weights.items()]
        stats = [sender.send(meta, iter(weights.values()), weight_version=str(v)) for v in (1, 2)]
        return {"ok": stats[-1]["bytes"] == sum(t.numel() * 2 for t in weights.values()),
                "gib": gib(stats[-1]["bytes"]), "buckets": stats[-1]["buckets"],
                "seconds": [round(s["seconds"], 3) for s in stats], "backend": sender.backend}
    finally:
        sender.close()
        server.shutdown()


# ---- 2. packed attention ---------------------------------------------------------------

def part_attention() -> dict:
    import torch.nn.functional as F

    from rlhf_trainer.parallel import context_parallel as cp

    features = cp.varlen_features()
    lengths, hq, hkv, dim = [517, 1200, 33, 2048, 300], 12, 2, 128
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    seg = cp.AttentionSegments.build(tuple(bounds), 0, bounds[-1]).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, bounds[-1], dim, device="cuda", generator=gen) for h in (hq, hkv, hkv))
    grad_out = torch.randn(1, bounds[-1], hq, dim, device="cuda", generator=gen)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        (out.float() * grad_out).sum().backward()
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    def reference(q_, k_, v_):  # per document, fp32, GQA by SDPA itself
        parts = [F.scaled_dot_product_attention(q_[:, :, a:b], k_[:, :, a:b], v_[:, :, a:b], is_causal=True,
                                                scale=dim ** -0.5, enable_gqa=True) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(parts, dim=2).transpose(1, 2)

    expected = run(reference, torch.float32)
    rows, worst = [], 0.0
    variants = {"this torch": features}
    if features and "enable_gqa" in features:
        variants["an older torch (no enable_gqa, no scale)"] = features - {"enable_gqa", "scale"}
    for label, feats in variants.items():
        cp.varlen_features.cache_clear()
        original = cp.varlen_features
        cp.varlen_features = lambda feats=feats: feats  # noqa: E731
        try:
            got = run(lambda a, b, c: cp.segment_attention(a, b, c, seg, dim ** -0.5, gqa=True), torch.bfloat16)
            ms = _time_ms(lambda: run(lambda a, b, c: cp.segment_attention(a, b, c, seg, dim ** -0.5, gqa=True),
                                      torch.bfloat16))
        finally:
            cp.varlen_features = original
        errors = {name: float((g - e).abs().max() / e.abs().max()) for name, g, e in  # noqa: C416
                  zip(("out", "dq", "dk", "dv"), got, expected)}
        worst = max(worst, *errors.values())
        rows.append({"kernel": label, "varlen keywords": ",".join(sorted(KEYWORDS & (feats or set())))
                     or "none (per-segment SDPA)",
                     **{f"rel err {k}": f"{v:.2e}" for k, v in errors.items()}, "fwd+bwd ms": ms})
    sdpa_ms = _time_ms(lambda: run(reference, torch.bfloat16))
    rows.append({"kernel": "per-document SDPA (bf16, reference shape)", "fwd+bwd ms": sdpa_ms})
    ok = worst < 5e-2
    return {"status": "ok" if ok else "failed", "tables": {"bf16 against fp32 SDPA with GQA": rows},
            "summary": f"varlen_attn keywords {sorted(KEYWORDS & features) if features else None}; worst relative error "
                       f"{worst:.2e} (bf16 vs fp32, limit 5e-2); {rows[0]['fwd+bwd ms']} ms vs SDPA {sdpa_ms} ms"}


def _time_ms(fn, repeat: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / repeat * 1000, 2)


def run_child(name: str, result: Path) -> int:
    """One part in this process; its result (or its error) as JSON in `result`."""
    from gpu_check_ipc import part_ipc
    from gpu_check_memory import part_memory
    from gpu_check_pair import part_failures, part_pair
    from gpu_check_parity import part_parity
    from gpu_check_train import part_demo, part_engines, part_gpu_tests, part_throughput

    parts = {"pair": part_pair, "failures": part_failures, "ipc": part_ipc, "parity": part_parity,
             "memory": part_memory, "engines": part_engines, "throughput": part_throughput,
             "gpu-tests": part_gpu_tests, "nccl": part_nccl, "attention": part_attention, "demo": part_demo}
    try:
        data = parts[name]()
        data.setdefault("status", "ok")
    except Exception as exc:  # noqa: BLE001  (the report carries it)
        data = {"status": "failed", "error": repr(exc)[:500], "traceback": traceback.format_exc()[-4000:]}
    result.write_text(json.dumps(data, default=str))
    return 0
