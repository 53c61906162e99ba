"""Real storage servers for the tests of `hf://` and `s3://` (defined once; fixtures in
conftest.py): versitygw (an S3-compatible gateway, posix backend over a directory, built by
tests/s3server/build.sh) and olah (a Hub mirror that serves local git repositories fully
offline, in its own venv: make olah). Each on a free port, started and stopped by the test.
Also the download step as the pods run it (`run_step`), and a directory's files (`files_of`)."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from rlhf_launcher.local import free_port

REPO = Path(__file__).resolve().parents[1]
OLAH_PYTHON = Path(os.environ.get("RLHF_OLAH_PYTHON", Path.home() / ".cache/rlhf-operator/olah-0.5.4/bin/python"))
S3_ACCESS_KEY, S3_SECRET_KEY = "rlhf-test-access", "rlhf-test-secret-key"
STEP_SECRET = "team-storage"
"""The storageSecret's name the download step is told (its errors name it)."""


def run_step(fetches, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """The download step as the init container runs it (`fetches`: rlhf_contract.sources.Fetch)."""
    from rlhf_contract.sources import plan_json

    return subprocess.run([sys.executable, "-m", "rlhf_trainer.storage", "--plan", plan_json(fetches), *extra],
                          env={**os.environ, "RLHF_STORAGE_SECRET": STEP_SECRET, "RLHF_TERMINATION_LOG": "/dev/null",
                               **env}, capture_output=True, text=True, timeout=120)


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def _wait(url: str, proc: subprocess.Popen, log: Path, ok=lambda r: True, timeout: float = 60,
          verify: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if ok(httpx.get(url, timeout=2, verify=verify)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer in {timeout} s: {log.read_text()[-2000:]}")


class S3Server:
    """versitygw on 127.0.0.1:<port> (or `host`: pods of the real node reach the host's
    address), serving `root` (one directory per bucket); in `region` (versitygw's --region:
    it refuses requests signed for another), over TLS with `tls` ((cert file, key file))."""

    def __init__(self, root: Path, host: str = "127.0.0.1", *, region: str = "us-east-1",
                 tls: tuple[Path, Path] | None = None):
        self.host, self.region, self.tls = host, region, tls
        self.root = root / "data"
        self.iam = root / "iam"  # versitygw's own accounts (add_user)
        self.root.mkdir(parents=True, exist_ok=True)
        self.iam.mkdir(exist_ok=True)
        out = subprocess.run(["bash", str(REPO / "tests/s3server/build.sh")], capture_output=True, text=True, check=True)
        self.binary = Path(out.stdout.strip()) / "versitygw"
        self.log = root / "versitygw.log"
        self.port = free_port()
        self.endpoint = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "--access", S3_ACCESS_KEY, "--secret", S3_SECRET_KEY, "--port", f"{self.host}:{self.port}",
                 "--region", self.region, *(["--cert", str(self.tls[0]), "--key", str(self.tls[1])] if self.tls else []),
                 "--iam-dir", str(self.iam), "posix", str(self.root)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self.endpoint, self.proc, self.log, verify=False)

    def add_user(self, access: str, secret: str) -> None:
        """An account with the `user` role: it reaches only the buckets it owns."""
        subprocess.run([str(self.binary), "admin", "--access", S3_ACCESS_KEY, "--secret", S3_SECRET_KEY,
                        "--region", self.region, "--endpoint-url", self.endpoint, "create-user", "--access", access, "--secret", secret,
                        "--role", "user"], check=True, capture_output=True)

    def kill(self) -> None:
        """SIGKILL: gone at once, mid-transfer."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def env(self, **changes: str) -> dict[str, str]:
        """The variables a job's pods get from its storageSecret (a change to "" drops one)."""
        env = {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
               "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": self.region, **changes}
        return {k: v for k, v in env.items() if v != ""}

    def client(self):
        from minio import Minio

        return Minio(f"{self.host}:{self.port}", access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY,
                     secure=bool(self.tls), cert_check=False, region=self.region)

    def put_dir(self, bucket: str, prefix: str, directory: Path) -> None:
        c = self.client()
        if not c.bucket_exists(bucket):
            c.make_bucket(bucket, location=self.region)
        for f in sorted(directory.rglob("*")):
            if f.is_file():
                c.fput_object(bucket, f"{prefix}/{f.relative_to(directory).as_posix()}", str(f))


class HubServer:
    """olah on 127.0.0.1:<port> (or `host`), offline, serving the git repositories under `root/mirrors`."""

    def __init__(self, root: Path, host: str = "127.0.0.1"):
        if not OLAH_PYTHON.exists():
            raise RuntimeError(f"{OLAH_PYTHON} is missing: run `make olah` (or set RLHF_OLAH_PYTHON)")
        self.root, self.mirrors = root, root / "mirrors"
        self.mirrors.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://{host}:{self.port}"
        config = root / "olah.toml"
        config.write_text(
            f'[basic]\nhost = "{host}"\nport = {self.port}\nrepos-path = "{root / "repos"}"\n'
            f'mirror-netloc = "{host}:{self.port}"\nmirror-lfs-netloc = "{host}:{self.port}"\n'
            f'mirrors-path = ["{self.mirrors}"]\n\n[accessibility]\noffline = true\n')
        self.log = root / "olah.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([str(OLAH_PYTHON), "-m", "olah.server", "-c", str(config)], cwd=root,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait(self.endpoint, self.proc, self.log, timeout=120)

    def add_repo(self, repo: str, directory: Path, *, kind: str = "model", tag: str | None = None) -> str:
        """Commit `directory`'s files as the repository `repo` (branch main, and `tag`); returns the commit."""
        target = self.mirrors / f"{kind}s" / repo
        shutil.copytree(directory, target)
        git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "init.defaultBranch=main"]
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "add"], *([["tag", tag]] if tag else [])):
            subprocess.run([*git, *args], cwd=target, check=True, capture_output=True)
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=target, check=True, capture_output=True,
                              text=True).stdout.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


class Served:
    """A tiny HTTP server on 127.0.0.1: `answer(handler, body) -> (status, headers, bytes)`,
    every request kept in `requests` as (method, path, headers, body)."""

    def __init__(self, answer):
        self.requests: list[tuple[str, str, dict, bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((self.command, self.path, dict(self.headers), body))
                status, headers, data = answer(self, body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:  # a HEAD passed on keeps the upstream's
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _any

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def forward(port: int, handler, body: bytes) -> tuple[int, dict, bytes]:
    """`handler`'s request passed on to 127.0.0.1:`port`; its answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(handler.command, handler.path, body=body or None, headers=dict(handler.headers))
    resp = conn.getresponse()
    data = resp.read()
    dropped = ("transfer-encoding", "connection") + (() if handler.command == "HEAD" else ("content-length",))
    headers = {("Content-Length" if k.lower() == "content-length" else k): v for k, v in resp.getheaders()
               if k.lower() not in dropped}
    conn.close()
    return resp.status, headers, data


class HubUploads:
    """The Hub's write routes in front of olah (which has none): `create_repo`, `preupload`
    (every file `regular`: sent inline in the commit), `commit` (the NDJSON body's files
    committed to the repository's git tree in olah's mirrors) and `tag`; every other request
    goes to olah, so what was pushed is downloaded through the Hub's own read protocol.
    `validate-yaml` (asked before a README.md is committed) accepts a card whose front matter
    is a YAML mapping, as the Hub's check starts."""

    def __init__(self, hub: HubServer):
        self.hub, self.commits = hub, []
        self.served = Served(self._answer)
        self.endpoint = self.served.url

    def _git(self, target: Path, *args: str) -> str:
        git = ["git", "-c", "user.name=hub", "-c", "user.email=hub@example.com", "-c", "init.defaultBranch=main"]
        return subprocess.run([*git, *args], cwd=target, check=True, capture_output=True, text=True).stdout.strip()

    def _answer(self, handler, body: bytes) -> tuple[int, dict, bytes]:
        import base64
        import json
        import re

        def reply(data, status=200):
            return status, {"Content-Type": "application/json"}, json.dumps(data).encode()

        path = handler.path.split("?")[0]
        if handler.command == "POST" and path == "/api/repos/create":
            repo = "/".join(p for p in (json.loads(body).get("organization"), json.loads(body)["name"]) if p)
            target = self.hub.mirrors / "models" / repo
            if not target.exists():
                target.mkdir(parents=True)
                for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "create"]):
                    self._git(target, *args)
            return reply({"url": f"{self.endpoint}/{repo}"})
        if handler.command == "POST" and path == "/api/validate-yaml":
            import yaml

            text = json.loads(body)["content"]
            front = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else None
            ok = isinstance(front, dict)
            return reply({"errors": [] if ok else [{"message": "no YAML metadata mapping"}], "warnings": []},
                         200 if ok else 400)
        found = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit|tag)/(.+)", path)
        if handler.command != "POST" or not found:
            return forward(self.hub.port, handler, body)
        repo, route, revision = found.groups()
        target = self.hub.mirrors / "models" / repo
        if route == "preupload":
            files = json.loads(body)["files"]
            return reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        if route == "tag":
            self._git(target, "tag", "-f", json.loads(body)["tag"], revision)
            return reply({})
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                dest = target / item["value"]["path"]
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(base64.b64decode(item["value"]["content"]))
            elif item["key"] == "header":
                message = item["value"]["summary"]
        self._git(target, "add", "-A")
        self._git(target, "commit", "-q", "--allow-empty", "-m", message)
        oid = self._git(target, "rev-parse", "HEAD")
        self.commits.append((repo, message, oid))
        return reply({"commitUrl": f"{self.endpoint}/{repo}/commit/{oid}", "commitOid": oid, "success": True})

    def close(self) -> None:
        self.served.close()
