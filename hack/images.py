#!/usr/bin/env python3
"""Builds the four images from their Dockerfiles and pushes them to a registry (`make images`).

    python3 hack/images.py [--registry R] [--version V] [--only NAMES] [--build-arg NAME=VALUE]...
                           [--insecure] [--lock dist/images.lock.json] [--builder auto|docker|podman|nerdctl|buildkit]

The builder: a Docker, Podman or nerdctl engine when one answers; otherwise BuildKit without
any daemon of the system's: `buildkitd` (started here, as root, with runc as its OCI worker)
and `buildctl`, both from the Go module proxy (`make node-tools`, tests/cluster/node/build.sh;
or on PATH, or $BUILDKIT_BIN). Each image is pushed as `<registry>/<name>:<version>`; the
digests go to the lock file (`images.lock.json`: what `make release` and the tests read).

Base images are build arguments (PYTHON_BASE_IMAGE, TORCH_BASE_IMAGE, VLLM_BASE_IMAGE; the
inference and colocated images share the vLLM base). `--insecure` talks plain
HTTP to the registry (a registry on loopback, as in the tests).

Only the standard library: runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = ("operator", "trainer", "inference", "colocated")
DOCKERFILES = {
    "operator": "operator/Dockerfile",
    "trainer": "trainer_image/Dockerfile",
    "inference": "inference_image/Dockerfile",
    "colocated": "colocated_image/Dockerfile",
}
BUILDKIT_STATE = Path(os.environ.get("RLHF_BUILDKIT_ROOT", Path.home() / ".cache" / "rlhf-operator" / "buildkit"))


def contract_defaults() -> tuple[str, str]:
    """(registry, version) as contract/rlhf_contract/images.py names them (read, not imported:
    no venv needed)."""
    ns: dict = {}
    exec((REPO / "contract" / "rlhf_contract" / "images.py").read_text(), ns)  # noqa: S102 - our own constants
    return ns["REGISTRY"], ns["VERSION"]


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Builders


class EngineBuilder:
    """docker / podman / nerdctl: `build` then `push`; the digest from the pushed image."""

    def __init__(self, cli: str, insecure: bool):
        self.cli = cli
        self.insecure = insecure

    def build(self, dockerfile: Path, context: Path, ref: str, args: dict[str, str], compression: str) -> str:
        cmd = [self.cli, "build", "-f", str(dockerfile), "-t", ref]
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        subprocess.run([*cmd, str(context)], check=True)
        push = [self.cli, "push"]
        if self.insecure and Path(self.cli).name in ("podman",):
            push.append("--tls-verify=false")
        subprocess.run([*push, ref], check=True)
        out = subprocess.run([self.cli, "image", "inspect", "--format", "{{json .RepoDigests}}", ref],
                             check=True, capture_output=True, text=True).stdout
        digests = [d.split("@", 1)[1] for d in json.loads(out or "[]") if "@" in d]
        if not digests:
            raise SystemExit(f"images: {self.cli} pushed {ref} but reports no digest")
        return digests[0]

    def close(self) -> None:
        pass


class BuildKit:
    """A private buildkitd (OCI worker on runc, host network, state cached outside the repo)
    and buildctl against its socket."""

    def __init__(self, bin_dir: Path, runc: Path, insecure_hosts: list[str]):
        self.bin_dir = bin_dir
        self.insecure_hosts = list(insecure_hosts)
        self.tmp = Path(tempfile.mkdtemp(prefix="rlhf-buildkit-"))
        self.sock = self.tmp / "buildkitd.sock"
        config = self.tmp / "buildkitd.toml"
        # BuildKit's cache is collected past this size (images of several GB each; the disk is shared)
        keep = os.environ.get("RLHF_BUILDKIT_KEEP", "24GB")
        lines = ["[worker.oci]", "  gc = true", f"  gckeepstorage = \"{keep}\"", ""]
        for host in insecure_hosts:
            lines += [f'[registry."{host}"]', "  http = true", "  insecure = true", ""]
        config.write_text("\n".join(lines))
        BUILDKIT_STATE.mkdir(parents=True, exist_ok=True)
        # One buildkitd per state directory.
        self._lock = open(BUILDKIT_STATE / ".lock", "a+")
        import fcntl
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        env = {**os.environ, "PATH": f"{runc.parent}:{bin_dir}:{os.environ.get('PATH', '')}"}
        self.log_path = self.tmp / "buildkitd.log"
        logf = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(bin_dir / "buildkitd"), "--root", str(BUILDKIT_STATE), "--addr", f"unix://{self.sock}",
             "--config", str(config), "--oci-worker=true", "--containerd-worker=false",
             "--oci-worker-binary", str(runc), "--oci-worker-net", "host", "--oci-worker-snapshotter", "overlayfs"],
            stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"images: buildkitd exited {self.proc.returncode}: "
                                 + self.log_path.read_text()[-3000:])
            ok = subprocess.run([str(bin_dir / "buildctl"), "--addr", f"unix://{self.sock}", "debug", "workers"],
                                capture_output=True).returncode == 0
            if ok:
                break
            if time.monotonic() > deadline:
                raise SystemExit("images: buildkitd did not answer in 60 s: " + self.log_path.read_text()[-3000:])
            time.sleep(0.3)

    def build(self, dockerfile: Path, context: Path, ref: str, args: dict[str, str], compression: str,
              push: bool = True) -> str:
        meta = self.tmp / "meta.json"
        meta.unlink(missing_ok=True)
        insecure = ",registry.insecure=true" if any(ref.startswith(h + "/") for h in self.insecure_hosts) else ""
        # Layers built here get `compression`; layers of the base keep theirs (forcing would
        # recompress the base's multi-GB layers on every build).
        output = f"type=image,name={ref},push={'true' if push else 'false'}{insecure},compression={compression}"
        cmd = [str(self.bin_dir / "buildctl"), "--addr", f"unix://{self.sock}", "build",
               "--frontend", "dockerfile.v0", "--local", f"context={context}",
               "--local", f"dockerfile={dockerfile.parent}", "--opt", f"filename={dockerfile.name}",
               "--output", output, "--metadata-file", str(meta), "--progress", "plain"]
        for k, v in args.items():
            cmd += ["--opt", f"build-arg:{k}={v}"]
        proc = subprocess.run(cmd)
        if proc.returncode != 0:
            raise SystemExit(f"images: buildctl failed for {ref} (exit {proc.returncode}); buildkitd log: "
                             f"{self.log_path}")
        return json.loads(meta.read_text())["containerimage.digest"]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._lock.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _node_tools() -> Path:
    """tests/cluster/node/build.sh's directory (BuildKit, and Debian's runc in debs/), built once."""
    log("building BuildKit from the Go module proxy and fetching runc from Debian (tests/cluster/node/build.sh, once)")
    out = subprocess.run(["bash", str(REPO / "tests" / "cluster" / "node" / "build.sh")], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit("images: could not build BuildKit (needs go >= 1.24 and apt-get download); "
                         "install docker, podman or nerdctl, or put buildkitd, buildctl and runc on PATH")
    return Path(out.stdout.strip().splitlines()[-1])


def find_buildkit() -> tuple[Path, Path]:
    """(directory with buildkitd and buildctl, runc binary): $BUILDKIT_BIN / $RUNC, PATH, or built."""
    if os.geteuid() != 0:
        raise SystemExit("images: BuildKit without a Docker engine runs buildkitd as root here; "
                         "run as root, or use docker/podman/nerdctl")
    bin_dir = os.environ.get("BUILDKIT_BIN") or (
        str(Path(shutil.which("buildkitd")).parent) if shutil.which("buildkitd") and shutil.which("buildctl") else None)
    runc = os.environ.get("RUNC") or shutil.which("runc")
    if bin_dir is None or runc is None:
        tools = _node_tools()
        bin_dir = bin_dir or str(tools / "bin")
        runc = runc or str(tools / "debs" / "usr" / "sbin" / "runc")
    return Path(bin_dir), Path(runc)


def engine_cli(name: str) -> str | None:
    path = shutil.which(name)
    if not path:
        return None
    ok = subprocess.run([path, "info"], capture_output=True, timeout=30).returncode == 0
    return path if ok else None


def make_builder(kind: str, registry: str, insecure: bool):
    host = registry.split("/", 1)[0]
    if kind in ("auto", "docker", "podman", "nerdctl"):
        for name in (("docker", "podman", "nerdctl") if kind == "auto" else (kind,)):
            cli = engine_cli(name)
            if cli:
                log(f"building with {cli}")
                return EngineBuilder(cli, insecure)
        if kind != "auto":
            raise SystemExit(f"images: {kind} does not answer (`{kind} info` failed)")
        log("no docker, podman or nerdctl engine answers: building with BuildKit")
    bin_dir, runc = find_buildkit()
    return BuildKit(bin_dir, runc, [host] if insecure else [])


# ---------------------------------------------------------------------------------------------


def build_images(registry: str, version: str, names: list[str], build_args: dict[str, str], builder,
                 compression: str) -> dict[str, dict[str, str]]:
    lock: dict[str, dict[str, str]] = {}
    for name in names:
        args = dict(build_args)
        ref = f"{registry}/{name}:{version}"
        t0 = time.monotonic()
        log(f"building {ref}")
        # Each Dockerfile declares the arguments it reads; pass only those (BuildKit warns on others).
        text = (REPO / DOCKERFILES[name]).read_text()
        used = {k: v for k, v in args.items() if f"ARG {k}" in text}
        digest = builder.build(REPO / DOCKERFILES[name], REPO, ref, used, compression)
        lock[name] = {"image": f"{registry}/{name}:{version}", "digest": digest,
                      "ref": f"{registry}/{name}:{version}@{digest}", "build_args": used,
                      "seconds": round(time.monotonic() - t0, 1)}
        log(f"pushed {ref}@{digest} in {lock[name]['seconds']} s")
    return lock


def main(argv: list[str] | None = None) -> int:
    default_registry, default_version = contract_defaults()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", default=os.environ.get("IMAGE_REGISTRY") or default_registry)
    ap.add_argument("--version", default=os.environ.get("IMAGE_VERSION") or default_version)
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(IMAGES))
    ap.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--insecure", action="store_true", help="plain HTTP to the registry (loopback registries)")
    ap.add_argument("--builder", default=os.environ.get("IMAGE_BUILDER", "auto"),
                    choices=["auto", "docker", "podman", "nerdctl", "buildkit"])
    ap.add_argument("--compression", default=os.environ.get("IMAGE_COMPRESSION", "gzip"),
                    choices=["gzip", "zstd", "uncompressed"],
                    help="layer compression with BuildKit (uncompressed: fastest on a loopback registry)")
    ap.add_argument("--lock", default=str(REPO / "dist" / "images.lock.json"))
    args = ap.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else IMAGES) if n]
    bad = [n for n in names if n not in IMAGES]
    if bad:
        ap.error(f"--only: unknown image(s) {bad}; choose from {', '.join(IMAGES)}")
    build_args = {}
    for item in args.build_arg:
        if "=" not in item:
            ap.error(f"--build-arg {item!r}: write NAME=VALUE")
        k, v = item.split("=", 1)
        build_args[k] = v
    builder = make_builder(args.builder, args.registry, args.insecure)
    try:
        lock = build_images(args.registry, args.version, names, build_args, builder, args.compression)
    finally:
        builder.close()
    path = Path(args.lock)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        old = json.loads(path.read_text())
    path.write_text(json.dumps({**old, **lock}, indent=2) + "\n")
    log(f"wrote {path}")
    for name, entry in lock.items():
        print(f"{name}\t{entry['ref']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
