"""Replacing a rollout server (rollout.maxServerReplacements) against two real CPU engine
processes: one is killed, the group is formed again with the other and the weights reach
it; the killed one is started again on its port, re-joins, and holds the trainer's weights
before the rollout client routes anything to it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_launcher.local import free_port
from rlhf_trainer.rl.replacement import ServerReplacement
from rlhf_trainer.rollout import RolloutClient
from rlhf_trainer.weight_sync import WeightSyncError, WeightSyncSender


def engine(model_dir, port: int, log) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_inference.cpu_engine", "--model", str(model_dir), "--host",
                             "127.0.0.1", "--port", str(port), "--num-threads", "1", "--served-model-name", "tiny"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"engine on {port} did not start")


def checksums(url: str) -> dict[str, str]:
    return httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=30).json()["checksums"]


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def push(sender, params: dict[str, torch.Tensor], version: str) -> None:
    sender.send([(n, list(t.shape), t.dtype) for n, t in params.items()], iter(params.values()), weight_version=version)


def test_killed_server_leaves_the_group_and_rejoins_with_the_current_weights(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [open(tmp_path / f"engine-{i}.log", "wb") for i in range(2)]
    procs = [engine(tiny_model_dir, p, log) for p, log in zip(ports, logs)]
    sender = WeightSyncSender(urls, "127.0.0.1", free_port(), bucket_bytes=16 * 1024, timeout_s=30)
    client = RolloutClient(urls, replace_servers=True)
    replacement = ServerReplacement(sender, client, budget=1)
    try:
        sender.init()
        gen = torch.Generator().manual_seed(0)
        v1 = {n: p.detach() + 0.1 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        push(sender, v1, "1")
        assert not replacement.changed()

        procs[1].kill()
        procs[1].wait()
        assert replacement.changed()
        replacement.before_push()  # the step boundary: the group formed again without it
        assert sender.endpoints == [urls[0]] and sender.world_size == 2 and replacement.count == 1
        assert urls[1] in client.left_out  # routed nothing
        v2 = {n: t + 0.1 for n, t in v1.items()}
        push(sender, v2, "2")
        replacement.after_push()
        assert checksums(urls[0]) == {n: sha256(t) for n, t in v2.items()}
        assert {client._pick() for _ in range(4)} == {urls[0]}

        procs[1] = engine(tiny_model_dir, ports[1], logs[1])  # restarted: the weights it started from
        assert checksums(urls[1]) != {n: sha256(t) for n, t in v2.items()}
        assert replacement.changed()
        replacement.before_push()
        assert sender.endpoints == urls and sender.world_size == 3 and sender.rank_offsets == [1, 2]
        assert urls[1] in client.left_out  # still routed nothing: it has not got the weights yet
        push(sender, v2, "2")  # the current weights, to both
        replacement.after_push()
        assert checksums(urls[1]) == {n: sha256(t) for n, t in v2.items()} == checksums(urls[0])
        assert httpx.get(urls[1] + "/weight_info").json() == {"weight_version": "2"}
        assert not client.left_out and {client._pick() for _ in range(4)} == set(urls)
        assert replacement.count == 1  # the return is not another replacement

        client.leave_out(urls[0])  # a dropped connection to a server that answers: re-joined, not counted
        assert replacement.changed()
        replacement.before_push()
        assert sender.endpoints == urls and urls[0] in client.left_out
        push(sender, v1, "3")
        replacement.after_push()
        assert not client.left_out and replacement.count == 1
        assert checksums(urls[0]) == {n: sha256(t) for n, t in v1.items()} == checksums(urls[1])

        procs[0].kill()  # a second loss: past the budget of 1, the attempt ends (exit 75)
        procs[0].wait()
        with pytest.raises(WeightSyncError, match="maxServerReplacements=1"):
            replacement.before_push()
    finally:
        sender.close()
        for proc in procs:
            proc.kill()
            proc.wait()
        for log in logs:
            log.close()
