"""S3 downloads, one stream vs parallel ranged parts (rlhf_trainer.storage.s3.download), against
a local versitygw: a model-shaped prefix (one large object and many small ones), fetched

  sequential   one request at a time, each object in one stream (what the step did before)
  parallel     s3.PARALLEL requests at once, objects over PART_BYTES in ranged parts

twice: straight to versitygw on loopback, and through a proxy that adds a round trip per
request and caps each connection's rate (as a remote S3 does: ~tens of ms per request, a
per-connection ceiling well below the link). Prints the seconds and the parallel/sequential
ratio of each, measured in the same run (the machine is shared: compare ratios, not seconds).

    .venv/bin/python bench/s3_download.py [--big-mib 48] [--small 32] [--rtt-ms 30] [--conn-mib-s 40]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def slow_proxy(upstream: int, rtt_s: float, rate: float) -> ThreadingHTTPServer:
    """Pass-through to 127.0.0.1:upstream, `rtt_s` before each answer, each body sent at `rate` B/s."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=120)
            conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
            resp = conn.getresponse()
            time.sleep(rtt_s)
            self.send_response(resp.status)
            for name, value in resp.getheaders():
                if name.lower() not in ("transfer-encoding", "connection"):
                    self.send_header(name, value)
            self.end_headers()
            start, sent = time.monotonic(), 0
            while self.command != "HEAD" and (chunk := resp.read(256 << 10)):
                self.wfile.write(chunk)
                sent += len(chunk)
                ahead = sent / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
            conn.close()

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def timed(endpoint: str, server, into: Path, **how) -> float:
    from rlhf_trainer.storage import s3

    os.environ.update(server.env(AWS_ENDPOINT_URL=endpoint))
    client = s3.client("bench")
    sizes: dict[str, int] = {}
    objects = s3.list_objects(client, "bench", "model", sizes)
    shutil.rmtree(into, ignore_errors=True)
    start = time.monotonic()
    s3.download(client, "bench", objects, "model", into, "bench", sizes, **how)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-mib", type=int, default=48)
    parser.add_argument("--small", type=int, default=32, help="objects of 512 KiB")
    parser.add_argument("--rtt-ms", type=float, default=30.0)
    parser.add_argument("--conn-mib-s", type=float, default=40.0)
    args = parser.parse_args()
    from rlhf_trainer.storage import s3
    from storage_servers import S3Server

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data"
        data.mkdir()
        (data / "model.safetensors").write_bytes(os.urandom(args.big_mib << 20))
        for i in range(args.small):
            (data / f"shard-{i:03d}.bin").write_bytes(os.urandom(512 << 10))
        server = S3Server(root / "server")
        try:
            server.put_dir("bench", "model", data)
            total = sum(f.stat().st_size for f in data.iterdir()) / (1 << 20)
            proxy = slow_proxy(server.port, args.rtt_ms / 1000, args.conn_mib_s * (1 << 20))
            slow = f"http://127.0.0.1:{proxy.server_address[1]}"
            print(f"{total:.0f} MiB: 1 x {args.big_mib} MiB + {args.small} x 512 KiB; parallel = {s3.PARALLEL} "
                  f"requests, parts of {s3.PART_BYTES >> 20} MiB")
            for name, endpoint in (("loopback", server.endpoint),
                                   (f"remote-like ({args.rtt_ms:.0f} ms, {args.conn_mib_s:.0f} MiB/s per "
                                    "connection)", slow)):
                seq = timed(endpoint, server, root / "copy", parallel=1, part_bytes=1 << 62)
                par = timed(endpoint, server, root / "copy")
                print(f"{name}: sequential {seq:.2f} s ({total / seq:.0f} MiB/s), parallel {par:.2f} s "
                      f"({total / par:.0f} MiB/s), speed-up x{seq / par:.2f}")
            proxy.shutdown()
        finally:
            server.kill()


if __name__ == "__main__":
    main()
