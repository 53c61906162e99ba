"""Builds what the real-pod tests run (`make test-images`, before pytest: a cold build takes
longer than one test may): the pause image, the bases made from Debian's archive and PyPI
(bases.py), and our four images from their own Dockerfiles with the same builder as
`make images` (hack/images.py, BuildKit), all pushed to the suite's registry, whose storage
is cached outside the repository. The references and digests go to a lock file,
~/.cache/rlhf-operator/test-images.lock.json, that the tests read.

A warm run: when the lock names the same inputs (every file the Dockerfiles copy, the
Dockerfiles, these scripts) and the registry still holds every digest, nothing starts but
the registry, for a second.

    python tests/cluster/images/build_test_images.py [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
sys.path.insert(0, str(TESTS))

from cluster.images import bases  # noqa: E402
from cluster.images.bases import image_builder  # noqa: E402  (hack/images.py)
from cluster.registry import Registry, node_tools  # noqa: E402

REPO = HERE.parents[2]
LOCK = Path.home() / ".cache" / "rlhf-operator" / "test-images.lock.json"
WORK = Path.home() / ".cache" / "rlhf-operator" / "test-images-work"
NAMESPACE = "rlhf-operator"
# What the Dockerfiles COPY (and so what a rebuild depends on).
SOURCES = ("pyproject.toml", "README.md", "hack/requirements.py", "hack/images.py", "contract", "operator",
           "trainer_image", "inference_image", "colocated_image", "launcher", ".dockerignore")


def inputs_hash() -> str:
    h = hashlib.sha256()
    files = []
    for src in SOURCES:
        p = REPO / src
        files += [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                                                   and not f.name.endswith((".pyc", ".egg-info")))
    for f in [*files, *sorted(HERE.glob("*")), REPO / "tests" / "cluster" / "node" / "build.sh"]:
        if f.is_file():
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def present(registry: Registry, lock: dict) -> bool:
    for entry in lock.get("images", {}).values():
        repo, _, tag = entry["image"].split("/", 1)[1].rpartition(":")
        if registry.digest(repo, tag) != entry["digest"]:
            return False
    return bool(lock.get("images"))


def build(force: bool = False) -> dict:
    t0 = time.monotonic()
    tools = node_tools()
    WORK.mkdir(parents=True, exist_ok=True)
    registry = Registry.start(WORK, tools, shared=True)
    collect = False
    try:
        want = inputs_hash()
        old = json.loads(LOCK.read_text()) if LOCK.exists() else {}
        if not force and old.get("inputs") == want and old.get("registry") == registry.host and present(registry, old):
            print(f"test images: up to date ({LOCK})", file=sys.stderr)
            return old
        builder = image_builder.BuildKit(tools / "bin", tools / "debs" / "usr" / "sbin" / "runc", [registry.host])
        try:
            timings: dict[str, float] = {}
            t = time.monotonic()
            with tempfile.TemporaryDirectory() as ctx:
                shutil.copy(tools / "bin" / "pause", Path(ctx) / "pause")
                shutil.copy(HERE / "pause.Dockerfile", Path(ctx) / "Dockerfile")
                pause_ref = f"{registry.host}/test-bases/pause:3.10"
                pause = f"{pause_ref}@{builder.build(Path(ctx) / 'Dockerfile', Path(ctx), pause_ref, {}, 'uncompressed')}"
            timings["pause"] = time.monotonic() - t
            t = time.monotonic()
            base_refs = bases.ensure_bases(registry, builder, tools)
            timings["bases"] = time.monotonic() - t
            version = image_builder.contract_defaults()[1]
            built = image_builder.build_images(f"{registry.host}/{NAMESPACE}", version, list(image_builder.IMAGES),
                                               base_refs, builder, bases.COMPRESSION)
            timings.update({name: entry["seconds"] for name, entry in built.items()})
        finally:
            builder.close()
        lock = {"inputs": want, "registry": registry.host, "pause": pause, "bases": base_refs,
                "images": {n: {"image": e["image"], "digest": e["digest"], "ref": e["ref"]} for n, e in built.items()},
                "seconds": {k: round(v, 1) for k, v in timings.items()},
                "built_in": round(time.monotonic() - t0, 1)}
        LOCK.write_text(json.dumps(lock, indent=2) + "\n")
        print(f"test images: built in {lock['built_in']} s {lock['seconds']}", file=sys.stderr)
        drop_old_bases(registry, lock)
        collect = True
        return lock
    finally:
        registry.stop()
        if collect:  # what no tag names any more (earlier builds' layers): gone from the disk
            subprocess.run([str(tools / "bin" / "registry"), "garbage-collect", "--delete-untagged",
                            str(WORK / "registry.yml")], capture_output=True)


def drop_old_bases(registry: Registry, lock: dict) -> None:
    """Untag the bases of earlier inputs (their layers are several GB)."""
    keep = {ref.split("@")[0] for ref in lock["bases"].values()}
    for name in bases.BASES:
        repo = f"test-bases/{name}"
        for tag in registry.tags(repo):
            if f"{registry.host}/{repo}:{tag}" not in keep:
                registry.delete(repo, tag)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="build even when the lock is up to date")
    args = ap.parse_args()
    build(force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
