"""A real OCI registry for the tests (distribution v3, built by tests/cluster/node/build.sh),
served over plain HTTP on loopback: the images `make images` builds are pushed here, the
real node's containerd pulls them from here, and `helm push` / `helm install oci://` use it.

Its storage lives outside the repository (~/.cache/rlhf-operator/registry/ or
$RLHF_REGISTRY_DIR), so a warm run finds the images a cold run pushed and builds nothing.
Only one registry serves that directory at a time (a lock file; a second waits); any other
registry (`Registry.start(dir)`) has a store of its own, on a free port.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from .procs import free_port, wait_for

NODE_BUILD = Path(__file__).resolve().parent / "node" / "build.sh"
DEFAULT_STORAGE = Path(os.environ.get("RLHF_REGISTRY_DIR",
                                      Path.home() / ".cache" / "rlhf-operator" / "registry"))


def node_tools() -> Path:
    """Build (or find) the node tools; return their directory (bin/, debs/)."""
    out = subprocess.run(["bash", str(NODE_BUILD)], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{NODE_BUILD} failed (exit {out.returncode})")
    return Path(out.stdout.strip().splitlines()[-1])


SHARED_PORT = int(os.environ.get("RLHF_REGISTRY_PORT", "5055"))


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        # as Go's listener does: connections of the last registry in TIME_WAIT do not count
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Registry:
    """`Registry.start(work_dir)` -> a running registry; `.host` is `127.0.0.1:<port>`."""

    def __init__(self, host: str, proc: subprocess.Popen, storage: Path, lock_fh):
        self.host = host
        self.proc = proc
        self.storage = storage
        self._lock_fh = lock_fh

    @classmethod
    def start(cls, work_dir: Path, tools: Path | None = None, storage: Path | None = None,
              shared: bool = False) -> "Registry":
        """A registry on a fresh store in `work_dir` (or `storage`), on a free port; with
        `shared`, the store cached outside the repository, on its fixed port (the test images)."""
        tools = tools or node_tools()
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        storage = Path(DEFAULT_STORAGE if shared else (storage or work_dir / "registry-data"))
        storage.mkdir(parents=True, exist_ok=True)
        lock_fh = open(storage / ".lock", "a+")
        deadline = time.monotonic() + (900 if shared else 0)
        while True:  # one registry serves a store at a time: the shared one waits its turn
            try:
                fcntl.flock(lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock_fh.close()
                    raise RuntimeError(f"{storage} is served by another registry (its .lock is held)") from None
                time.sleep(1)
        # The shared store is served on one fixed port: image references (and BuildKit's
        # cache keys of FROM lines) name the registry's address, so a warm run finds them again.
        port = free_port()
        if shared:
            deadline = time.monotonic() + 30
            while not _port_free(SHARED_PORT) and time.monotonic() < deadline:
                time.sleep(0.5)
            if not _port_free(SHARED_PORT):
                raise RuntimeError(f"port {SHARED_PORT} (the shared registry's, RLHF_REGISTRY_PORT) is taken")
            port = SHARED_PORT
        host = f"127.0.0.1:{port}"
        config = work_dir / "registry.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
            "http": {"addr": host},
        }))
        log = open(work_dir / "registry.log", "ab")
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
        proc = subprocess.Popen([str(tools / "bin" / "registry"), "serve", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        reg = cls(host, proc, storage, lock_fh)
        try:
            wait_for(lambda: proc.poll() is None and reg._get("/v2/") is not None, 30, f"registry at {host}")
        except Exception:
            reg.stop()
            raise RuntimeError("registry did not start: " + (work_dir / "registry.log").read_text()[-2000:])
        return reg

    def _get(self, path: str, accept: str | None = None):
        req = urllib.request.Request(f"http://{self.host}{path}")
        if accept:
            req.add_header("Accept", accept)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.headers, r.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        except (urllib.error.URLError, OSError):
            return None

    def digest(self, repository: str, tag: str) -> str | None:
        """The manifest digest of `repository:tag`, or None when the tag does not exist."""
        accept = ",".join([
            "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.docker.distribution.manifest.v2+json",
            "application/vnd.docker.distribution.manifest.list.v2+json",
        ])
        got = self._get(f"/v2/{repository}/manifests/{tag}", accept)
        return None if got is None else got[0].get("Docker-Content-Digest")

    def delete(self, repository: str, tag: str) -> None:
        """Untag `repository:tag` (its manifest; `registry garbage-collect` frees the layers)."""
        digest = self.digest(repository, tag)
        if digest:
            req = urllib.request.Request(f"http://{self.host}/v2/{repository}/manifests/{digest}", method="DELETE")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(req, timeout=10).close()

    def tags(self, repository: str) -> list[str]:
        got = self._get(f"/v2/{repository}/tags/list")
        return [] if got is None else (json.loads(got[1]).get("tags") or [])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            if self.proc.poll() is None:
                self.proc.kill()
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None
