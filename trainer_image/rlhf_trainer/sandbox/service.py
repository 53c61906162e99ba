"""The code sandbox as a service: runs model-written programs OUT of the trainer's pod.

    python -m rlhf_trainer.sandbox.service --port 8080 [--allow-rlimits-only]

`POST /run_many` with `{"jobs": [[code, stdin], ...], "limits": {...sandbox.Limits},
"require_isolation": bool}` answers `{"results": [SandboxResult, ...]}` in order, or HTTP 500
`{"error": ...}` when the sandbox itself fails (the client raises SandboxError). Programs go
through this process's ONE bounded queue (`sandbox.capacity()`: the pod's CPU quota and memory
limit); a full queue makes requests wait. `GET /healthz` answers the backend and capacity.

The service never sees expected outputs: the trainer compares them, so a program that reads
everything this pod holds still learns nothing it must print.

On a cluster the operator runs it as the container's PID 1 in a pod without a token, data or
egress (see `rlhf_operator.builders.sandbox`). As PID 1 it cannot be killed from inside its
PID namespace (the kernel drops signals to init that it has no handler for, and `kill(-1)`
skips init): with the `rlimits` backend a program that calls `kill(-1)` kills other programs,
never the service. PID 1 also reaps and kills orphans a program left behind (its children that
called setsid), and the service makes itself non-dumpable so programs of the same uid cannot
ptrace it or read its memory.

`client.SandboxClient(url).run_many(jobs, limits)` is the trainer's side, with the same
signature as `sandbox.run_many`. This program is the trainer image's second entry point: it
imports nothing of the trainer but this package and `rlhf_trainer.retry` (standard library
only).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlhf_trainer.sandbox.cgroup import capacity
from rlhf_trainer.sandbox.limits import Limits, SandboxError
from rlhf_trainer.sandbox.run import (LIVE_PIDS, SPAWN_LOCK, isolation, run_many,
                                      set_rlimits_only_allowed)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 << 20
MAX_JOBS_PER_REQUEST = 4096
PR_SET_DUMPABLE = 4


class _Handler(BaseHTTPRequestHandler):
    server_version = "rlhf-sandbox/1"

    def log_message(self, fmt: str, *args) -> None:  # quiet: one line per request at debug
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/healthz":
            return self._answer(404, {"error": f"no route {self.path}"})
        iso = isolation()
        self._answer(200, {"backend": iso.backend, "reason": iso.reason,
                           "capacity": capacity(Limits())})

    def do_POST(self) -> None:
        if self.path != "/run_many":
            return self._answer(404, {"error": f"no route {self.path}"})
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            return self._answer(413, {"error": f"body must be 1..{MAX_BODY_BYTES} bytes"})
        try:
            request = json.loads(self.rfile.read(length))
            jobs = [(str(code), str(stdin)) for code, stdin in request["jobs"]]
            limits = Limits(**request.get("limits", {}))
            require = bool(request.get("require_isolation", True))
        except (ValueError, KeyError, TypeError) as err:
            return self._answer(400, {"error": f"bad request: {type(err).__name__}: {err}"})
        if len(jobs) > MAX_JOBS_PER_REQUEST:
            return self._answer(413, {"error": f"at most {MAX_JOBS_PER_REQUEST} jobs a request"})
        try:
            results = run_many(jobs, limits, require_isolation=require)
        except SandboxError as err:
            return self._answer(500, {"error": str(err)})
        self._answer(200, {"results": [r.to_json() for r in results]})


def _reap_and_kill_orphans(stop: threading.Event) -> None:
    """As PID 1: reap exited processes that are not ours to wait for, and SIGKILL live
    processes reparented to us that no run owns (a program's setsid'ed descendants)."""
    me = os.getpid()
    while not stop.wait(0.5):
        with SPAWN_LOCK:
            live = set(LIVE_PIDS)
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in live or int(entry) == me:
                    continue
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == me:
                    try:
                        os.kill(int(entry), signal.SIGKILL)
                    except OSError:
                        pass
            while True:
                try:
                    info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    break
                if info is None or info.si_pid in live:
                    break
                try:
                    os.waitpid(info.si_pid, 0)
                except ChildProcessError:
                    break


def serve(host: str, port: int, *, allow_rlimits_only: bool = False) -> None:
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    iso = isolation()
    if iso.backend != "bwrap" and not allow_rlimits_only:
        logger.warning("no per-run namespaces here (%s); requests that require isolation fail",
                       iso.reason)
    set_rlimits_only_allowed(allow_rlimits_only)
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    stop = threading.Event()
    if os.getpid() == 1:
        threading.Thread(target=_reap_and_kill_orphans, args=(stop,), daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    logger.warning("sandbox service on %s:%d, backend %s, %d runs at once", host, port,
                   iso.backend, capacity(Limits()))
    try:
        server.serve_forever()
    finally:
        stop.set()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--allow-rlimits-only", action="store_true",
                        help="let requests run programs without per-run namespaces")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve(args.host, args.port, allow_rlimits_only=args.allow_rlimits_only)


if __name__ == "__main__":
    main()
