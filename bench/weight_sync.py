"""Weight-sync throughput against the transport's own limit, measured in the same run.

Pushes every parameter of a ~50 MB Qwen2 (random weights, made in code) from this process
(as trainer rank 0) to a CPU rollout server over the real HTTP + gloo protocol, in packed
buckets, and compares with a raw gloo broadcast of ONE flat buffer of the same size to a
bare receiver process: the most this transport can do here. Prints both rates and their
ratio (1.0 = the protocol costs nothing on top of the transport), and where the best
round's time went (each HTTP step of the round; /update_weights includes packing, the
broadcasts and the server's copy into its model).

    .venv/bin/python bench/weight_sync.py [--rounds 5] [--bucket-mb 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from rlhf_launcher.local import free_port
from rlhf_trainer.weight_sync import WeightSyncSender

RECEIVER = textwrap.dedent("""
    import datetime, sys, torch, torch.distributed as dist
    host, port, nbytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    t = datetime.timedelta(seconds=300)
    store = dist.TCPStore(host, port, 2, is_master=False, timeout=t)
    pg = dist.ProcessGroupGloo(store, 1, 2, t)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        pg.broadcast(buf, 0).wait()
""")


def make_model(path: Path) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trainer.models.builtin import build_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=16, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return model


def raw_broadcast_seconds(nbytes: int, rounds: int) -> float:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), str(nbytes), str(rounds)])
    t = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=t)
    pg = dist.ProcessGroupGloo(store, 0, 2, t)
    buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        pg.broadcast(buf, 0).wait()
        times.append(time.perf_counter() - start)
    proc.wait(60)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        params = list(model.named_parameters())
        nbytes = sum(p.numel() * p.element_size() for _, p in params)
        port = free_port()
        engine = subprocess.Popen([sys.executable, "-m", "rlhf_inference.cpu_engine", "--model", tmp, "--host", "127.0.0.1",
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or engine.poll() is not None:
                    raise SystemExit("engine did not start")
                time.sleep(0.3)
            sender = WeightSyncSender([url], "127.0.0.1", free_port(), bucket_bytes=args.bucket_mb << 20)
            sender.init()
            metadata = [(n, list(p.shape), p.dtype) for n, p in params]
            sync, phases = [], []
            for i in range(args.rounds):
                start = time.perf_counter()
                sender.send(metadata, (p.detach() for _, p in params), weight_version=str(i))
                sync.append(time.perf_counter() - start)
                phases.append(dict(sender.phase_seconds))
            sender.close()
        finally:
            engine.terminate()
            engine.wait(30)
    raw = raw_broadcast_seconds(nbytes, args.rounds)
    mb = nbytes / 1e6
    print(f"model: {len(params)} tensors, {mb:.1f} MB; bucket {args.bucket_mb} MiB; best of {args.rounds} rounds")
    print(f"weight sync (HTTP + packed gloo broadcast + load): {min(sync):.3f} s = {mb / min(sync):.0f} MB/s")
    print(f"raw gloo broadcast of one flat buffer:             {raw:.3f} s = {mb / raw:.0f} MB/s")
    best = phases[sync.index(min(sync))]
    print("best round: " + ", ".join(f"{path} {seconds * 1000:.1f} ms" for path, seconds in best.items()))
    print(f"ratio sync / raw transport: {raw / min(sync):.2f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
