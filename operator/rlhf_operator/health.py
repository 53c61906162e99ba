"""The operator's liveness endpoint (`--health-port`, the chart's probes): GET /healthz
answers 200 while the process makes progress, 503 once it has not for `stale_after_s`.

Progress is a heartbeat: while a replica waits for the leader lease, each try to take it
beats; once it leads, a task on kopf's own event loop beats every `BEAT_S` seconds, so a
stuck loop (a blocking call in a handler, a deadlock) stops the beats and the kubelet
restarts the pod. /readyz answers 200 once the process has started (a standby is ready:
it serves metrics and takes over when the leader goes)."""

from __future__ import annotations

import http.server
import threading
import time

BEAT_S = 2.0
STALE_AFTER_S = 30.0


class Heartbeat:
    def __init__(self, stale_after_s: float = STALE_AFTER_S):
        self.stale_after_s = stale_after_s
        self.last = time.monotonic()
        self.what = "starting"

    def beat(self, what: str) -> None:
        self.last, self.what = time.monotonic(), what

    def age(self) -> float:
        return time.monotonic() - self.last

    def healthy(self) -> bool:
        return self.age() < self.stale_after_s


def serve(port: int, heartbeat: Heartbeat) -> http.server.ThreadingHTTPServer | None:
    """Answer /healthz and /readyz on `port` (0: off) from a daemon thread."""
    if not port:
        return None

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            if path == "/healthz":
                ok = heartbeat.healthy()
                body = (f"ok: {heartbeat.what}, {heartbeat.age():.1f} s ago" if ok else
                        f"stuck: no progress for {heartbeat.age():.0f} s (last: {heartbeat.what})").encode()
                self.send_response(200 if ok else 503)
            elif path == "/readyz":
                body, ok = b"ok", True
                self.send_response(200)
            else:
                body = b"not found"
                self.send_response(404)
            self.send_header("content-type", "text/plain")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="health").start()
    return server
