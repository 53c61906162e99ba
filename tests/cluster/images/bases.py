"""Base images for the tests, made here because no container registry can be pulled from:

    python  Debian bookworm from Debian's archive (debootstrap, minbase + python3), Python in a
            venv first on PATH                         -> PYTHON_BASE_IMAGE (operator image)
    torch   + PyPI's torch (the trainer's pin)         -> TORCH_BASE_IMAGE (trainer image)
    vllm    + PyPI's vLLM wheel (the pinned release)   -> VLLM_BASE_IMAGE (inference image)

Built with the same BuildKit as `make images` (hack/images.py) and pushed to the suite's
registry under `test-bases/<name>:<hash of their inputs>`, so a warm run finds them there and
builds nothing. The rootfs tarball is cached in ~/.cache/rlhf-operator/debian-rootfs/.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]

def _load_builder():
    """hack/images.py (one builder for users and tests), loaded from its file."""
    import importlib.util

    if "rlhf_hack_images" in sys.modules:
        return sys.modules["rlhf_hack_images"]
    spec = importlib.util.spec_from_file_location("rlhf_hack_images", REPO / "hack" / "images.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlhf_hack_images"] = module
    spec.loader.exec_module(module)
    return module


image_builder = _load_builder()

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("RLHF_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# python3-dev: the headers a python:*-slim or pytorch image has (sdists such as pycosat build
# against them; so do DeepSpeed's JIT ops).
ROOTFS_PACKAGES = "python3,python3-venv,python3-dev,ca-certificates"
ROOTFS_CACHE = Path.home() / ".cache" / "rlhf-operator" / "debian-rootfs"
BASES = ("python", "torch", "vllm")
COMPRESSION = "zstd"  # the torch and vLLM layers are several GB: the registry keeps them compressed
BASE_ARG = {"python": "PYTHON_BASE_IMAGE", "torch": "TORCH_BASE_IMAGE", "vllm": "VLLM_BASE_IMAGE"}


EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")


def extra_cas() -> list[Path]:
    return sorted(EXTRA_CA_DIR.glob("*.crt")) if EXTRA_CA_DIR.is_dir() else []


def inputs_hash(name: str) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for ca in extra_cas():
        h.update(ca.read_bytes())
    for base in BASES[: BASES.index(name) + 1]:  # a base changes when anything below it does
        h.update((HERE / f"{base}.Dockerfile").read_bytes())
    return h.hexdigest()[:16]


def rootfs_tar(tools: Path) -> Path:
    """A minbase bookworm rootfs with python3 as a tarball (cached)."""
    key = hashlib.sha256(f"{DEBIAN_SUITE} {ROOTFS_PACKAGES} {DEBIAN_MIRROR}".encode()).hexdigest()[:16]
    out = ROOTFS_CACHE / f"rootfs-{key}.tar"
    if out.exists():
        return out
    ROOTFS_CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=ROOTFS_CACHE))
    try:
        target = work / "root"
        debs = tools / "debs"
        env = {**os.environ, "DEBOOTSTRAP_DIR": str(debs / "usr" / "share" / "debootstrap")}
        proc = subprocess.run([str(debs / "usr" / "sbin" / "debootstrap"), "--variant=minbase",
                               f"--include={ROOTFS_PACKAGES}", DEBIAN_SUITE, str(target), DEBIAN_MIRROR],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        shutil.rmtree(target / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (target / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        tmp_tar = work / "rootfs.tar"
        # Device nodes, /proc and /sys are the runtime's to provide.
        subprocess.run(["tar", "-C", str(target), "--numeric-owner", "--exclude=./dev/*", "--exclude=./proc/*",
                        "--exclude=./sys/*", "-cf", str(tmp_tar), "."], check=True)
        tmp_tar.rename(out)
        for old in ROOTFS_CACHE.glob("rootfs-*.tar"):  # other package sets: stale
            if old != out:
                old.unlink()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_bases(registry, builder, tools: Path, names=BASES) -> dict[str, str]:
    """Build (or find in `registry`) the test bases; return {build-arg name: ref@digest}."""
    refs: dict[str, str] = {}
    for name in names:
        repo = f"test-bases/{name}"
        tag = inputs_hash(name)
        ref = f"{registry.host}/{repo}:{tag}"
        digest = registry.digest(repo, tag)
        if digest is None:
            args = {k: v for k, v in refs.items()}
            with tempfile.TemporaryDirectory(prefix=f"base-{name}-") as ctx:
                if name == "python":
                    (Path(ctx) / "extra-ca").mkdir()
                    for ca in extra_cas():
                        shutil.copy(ca, Path(ctx) / "extra-ca" / ca.name)
                    try:
                        os.link(rootfs_tar(tools), Path(ctx) / "rootfs.tar")
                    except OSError:  # another filesystem
                        shutil.copy(rootfs_tar(tools), Path(ctx) / "rootfs.tar")
                shutil.copy(HERE / f"{name}.Dockerfile", Path(ctx) / "Dockerfile")
                digest = builder.build(Path(ctx) / "Dockerfile", Path(ctx), ref, args, COMPRESSION)
        refs[BASE_ARG[name]] = f"{ref}@{digest}"
    return refs
