"""The sandbox service down in the middle of a batch of runs (fault 5 of the reliability
table): the trainer's real client against the real service, killed mid-batch. Back within
the client's retries, the batch completes; down for good, the step fails naming the URL.
(A tiny model writes no fenced code, so a whole training run never reaches the sandbox.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rlhf_contract.sandbox import sandbox_command
from rlhf_trainer import sandbox
from rlhf_trainer.sandbox import Limits, SandboxClient, SandboxError

ISO = sandbox.isolation()
pytestmark = pytest.mark.skipif(ISO.backend != "bwrap", reason=f"no bubblewrap: {ISO.reason}")

PROGRAM = "import time\ntime.sleep(1.0)\nprint(int(input()) * 2)\n"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _service(port: int) -> subprocess.Popen:
    command = sandbox_command(host="127.0.0.1", port=port, python=sys.executable, require_isolation=True)
    proc = subprocess.Popen(command, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the sandbox service did not start")


def test_the_service_killed_mid_batch_and_back_within_the_retries_loses_no_run():
    port = _port()
    first = _service(port)
    client = SandboxClient(f"http://127.0.0.1:{port}", chunk=2, max_in_flight=2)  # retries at 2, 4, 8 s
    jobs = [(PROGRAM, f"{i}\n") for i in range(8)]
    results, errors = [], []
    worker = threading.Thread(target=lambda: _collect(client, jobs, results, errors))
    worker.start()
    time.sleep(1.5)  # the first chunks are running
    first.kill()
    first.wait()
    second = _service(port)  # back before the client's last retry
    try:
        worker.join(120)
        assert not errors, errors
        [batch] = results
        assert [r.stdout.strip() for r in batch] == [str(2 * i) for i in range(8)]  # every run, in order
    finally:
        second.kill()
        second.wait()


def test_the_service_down_for_good_fails_the_step_naming_it():
    port = _port()
    client = SandboxClient(f"http://127.0.0.1:{port}", retries=2)  # 2 s then 4 s apart
    started = time.monotonic()
    with pytest.raises(SandboxError, match=rf"sandbox service http://127.0.0.1:{port} failed 3 times; "
                                           r"last: ConnectError.*is reward.sandbox.url right, and the service up"):
        client.run_many([(PROGRAM, "1\n")], Limits(timeout_s=5))
    assert time.monotonic() - started < 30  # bounded, not a hang


def _collect(client, jobs, results, errors):
    try:
        results.append(client.run_many(jobs, Limits(timeout_s=5)))
    except Exception as err:  # noqa: BLE001 - reported by the test
        errors.append(err)
