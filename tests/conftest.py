"""Shared fixtures: the built-in tiny model on disk and real CPU engine processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# One CPU thread per process, in the xdist workers and in everything the suite starts
# (rlhfctl runs, their rollout servers and trainers, torchrun workers). `make test` runs two
# workers on two cores, and each local run starts three or more processes: with torch's
# default of a thread per core, their OpenMP pools spun against each other and learners took
# 3-5x their quiet time (the tool-calling test's SFT: 6x, until it set this itself).
os.environ["OMP_NUM_THREADS"] = "1"

import httpx
import pytest
from rlhf_launcher.local import free_port  # noqa: E402  (one definition)

# Bytecode caches on: the suite starts hundreds of Python processes (rlhfctl, servers,
# trainers, torchrun workers), and with PYTHONDONTWRITEBYTECODE set (as in our CI shell) and
# a venv installed without .pyc files (uv's default), each one compiled torch and
# transformers from source again: ~9 of the 11 CPU seconds of `rlhfctl run`'s own start-up,
# a 2-step local run 40 s instead of 16 s. The first process that imports a module now
# writes its .pyc (atomically); every later one reads it. Set here, before the xdist workers
# and any test's subprocess start, so all of them inherit it.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers, scheduled by tests/scheduling.py (file units,
    tests/cluster/ on one worker, long tiers first, CPU learners not beside the real-pod job)."""
    from scheduling import FileScheduling

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """`builtin://tiny-qwen2` (seed 0) written once per test session."""
    from rlhf_trainer.models.builtin import materialize

    return materialize("builtin://tiny-qwen2", tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def tools_tokenizer(tmp_path_factory):
    """The tokenizer of builtin://tiny-qwen2-tools (its Hermes / Qwen-style chat template renders tools)."""
    from transformers import AutoTokenizer

    from rlhf_trainer.models.builtin import materialize_tokenizer

    return AutoTokenizer.from_pretrained(materialize_tokenizer("builtin://tiny-qwen2-tools",
                                                               tmp_path_factory.mktemp("tools-tok")))


@pytest.fixture(scope="session")
def start_engines(tmp_path_factory):
    """Factory: `with start_engines(model_dir, count) as urls:` runs `count` CPU engines
    (`python -m rlhf_inference.cpu_engine`) on free 127.0.0.1 ports until the block ends."""

    @contextlib.contextmanager
    def start(model_dir, count: int = 1, *extra_args: str, ready_timeout_s: float = 90.0):
        logs = tmp_path_factory.mktemp("engine-logs")
        procs, urls = [], []
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        try:
            for i in range(count):
                port = free_port()
                log = open(logs / f"engine-{i}.log", "wb")
                procs.append((subprocess.Popen(
                    [sys.executable, "-m", "rlhf_inference.cpu_engine", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--port", str(port), "--num-threads", "1",
                     "--served-model-name", "tiny", *extra_args],
                    stdout=log, stderr=subprocess.STDOUT, env=env), log))
                urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + ready_timeout_s
            for (proc, log), url in zip(procs, urls):
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"engine exited with {proc.returncode}: "
                                           + Path(log.name).read_text()[-3000:])
                    with contextlib.suppress(httpx.HTTPError):
                        if httpx.get(url + "/health", timeout=2).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engine at {url} not ready in {ready_timeout_s} s")
                    time.sleep(0.2)
            yield urls
        finally:
            for proc, log in procs:
                proc.terminate()
            for proc, log in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()

    return start


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (versitygw, tests/storage_servers.py) for the session."""
    from storage_servers import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.kill()


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory):
    """A real Hub-protocol server (olah, offline, tests/storage_servers.py) for the session."""
    from storage_servers import HubServer

    server = HubServer(tmp_path_factory.mktemp("hub"))
    yield server
    server.stop()
