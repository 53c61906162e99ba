"""Files on the job's volume that other processes trust: names from a server kept inside
their directory (`confined`), markers written so that a reader sees all of one or none
(`write_atomic`), and what a marker says a copy holds (`listing`, `listing_matches`).

Not done: a file is not re-hashed when a copy is reused (its name and size are checked; the
sha256 recorded at download is for a reader who wants to check more)."""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
from pathlib import Path, PurePosixPath

from . import StorageError


def confined(root: Path, name: str, what: str) -> Path:
    """`root/name` for a relative POSIX name from a server (an S3 key below its prefix, a
    checkpoint file); refused (permanent: the bucket has to change) when the name is
    absolute, has an empty, `.` or `..` segment, or resolves outside `root`."""
    parts = PurePosixPath(name).parts
    if (not name or name.startswith("/") or "\x00" in name
            or any(p in ("", ".", "..") for p in name.split("/")) or not parts):
        raise StorageError(f"{what}: refusing the object name {name!r}: it would leave {root} (absolute, or with "
                           "'.'/'..'/empty segments); remove or rename it in the bucket", permanent=True)
    target = root.joinpath(*parts)
    base = root.resolve()
    if not target.resolve().is_relative_to(base):
        raise StorageError(f"{what}: refusing the object name {name!r}: it resolves outside {root}", permanent=True)
    return target


def unique_name(stem: str) -> str:
    """A name no other process on any node picks: `<stem>.<host>.<pid>.<random>`."""
    return f"{stem}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(6)}"


def remove_abandoned(directory: Path, stem: str) -> None:
    """Delete the `unique_name(stem)` entries of `directory` left by processes of this host
    that are gone (a pod killed mid-download); other hosts' are left to their owners."""
    host = socket.gethostname()
    for entry in directory.glob(f"{stem}.{host}.*"):
        pid = entry.name[len(f"{stem}.{host}."):].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write `text` (or bytes) to `path` so that a crash leaves the old file or the whole new one: a
    unique temporary file beside it, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(unique_name(f".{path.name}") + ".tmp")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def create_exclusive(path: Path, text: str) -> bool:
    """Write `path` whole only if it does not exist (hard link of a synced temporary file:
    atomic, and exclusive on NFS too). False: another process made it first."""
    tmp = path.with_name(unique_name(f".{path.name}") + ".tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def listing(target: Path, *, digests: bool = True) -> dict[str, dict]:
    """{relative name: {"size", "sha256"}} of every file of `target` (a file: its name "")."""
    files = [target] if target.is_file() else sorted(f for f in target.rglob("*") if f.is_file())
    out = {}
    for f in files:
        name = "" if f == target else f.relative_to(target).as_posix()
        out[name] = {"size": f.stat().st_size, **({"sha256": _sha256(f)} if digests else {})}
    return out


def listing_matches(target: Path, recorded: object) -> str | None:
    """What differs between the copy at `target` and the listing its marker recorded (names
    and sizes; a file added since is not counted); None when they match."""
    if not isinstance(recorded, dict) or not recorded:
        return "its marker lists no files"
    if not target.exists():
        return f"{target} is missing"
    actual = listing(target, digests=False)
    for name, entry in recorded.items():
        if name not in actual:
            return f"{name or target.name} is missing"
        if not isinstance(entry, dict) or actual[name]["size"] != entry.get("size"):
            return f"{name or target.name} has {actual[name]['size']} bytes, its marker says {entry}"
    return None
