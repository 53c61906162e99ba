"""Processes of the test control plane: finding the binaries, waiting, and stopping only
the processes we started (by pid, checked against the binary directory)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable
from rlhf_launcher.local import free_port  # noqa: E402  (one definition)

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"


class ClusterError(RuntimeError):
    pass


def ensure_binaries(quiet: bool = False) -> Path:
    """Build (or find in the cache) the control-plane binaries; return their directory."""
    override = os.environ.get("RLHF_CLUSTER_BIN")
    if override:
        return Path(override)
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )
    if proc.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT} failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def binaries_built() -> bool:
    if os.environ.get("RLHF_CLUSTER_BIN"):
        return True
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True)
    return (Path(out.stdout.strip()) / ".complete").exists()




def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - polled condition may fail transiently
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pid_alive(pid: int, bin_dir: Path) -> bool:
    """True when `pid` runs one of our binaries (guards against recycled pids)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return Path(exe).parent == Path(bin_dir)


def terminate(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM one by one in the given order (clients before the API server before etcd:
    an API server whose etcd is gone shuts down slowly), SIGKILL after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _exists(pid):
            time.sleep(0.1)
        if _exists(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        # Reap it if it is our child; otherwise just probe.
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False
