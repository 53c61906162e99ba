"""Which files of a `--working-dir` go to the cluster, and reading them within the caps
(workdir.py packs them into ConfigMaps). Everything is decided from names and `lstat`
before a byte is read; a file is then read through one descriptor, at most the cap.

The rules, in order:
- left out (never read, never a reason to refuse): `.git` at any depth; then, last match
  wins as in git, the defaults (`.*` hidden entries, `__pycache__/`), each `.gitignore`
  and then `.rlhfignore` from DIR down to the entry's directory (a deeper file overrides a
  shallower one; `!pattern` re-includes, so `!.config/` in `.rlhfignore` sends a hidden
  directory), and last `--exclude PATTERN`. A directory left out is not walked (git's
  rule: nothing under it can be re-included).
- skipped with a note: fifos, sockets and devices (never opened: a fifo would hang) and
  links to a directory inside DIR (not followed: its target is sent where it is).
- refused, naming each (and then nothing is sent): a link whose target is outside DIR
  (or missing); a credential-looking file (`CREDENTIAL_NAMES`, or a private key inside) unless named by
  `--include-secret PATH`; more than `MAX_FILES` files, a file over one ConfigMap or a
  total over `MAX_CONFIGMAPS` of them (by `lstat`, before any read).
- a link to a file inside DIR is sent at the link's path as a copy of its target (a
  ConfigMap holds no links); the credential rules look at both names.
A file is read only if it is still the one `lstat` saw (same device and inode, opened with
`O_NOFOLLOW`): a file swapped for a link or a fifo between the scan and the read is refused.

Simplifications: only the ignore files inside DIR count (not those of a repository above
it, nor `.git/info/exclude` or git's global excludes); the size checked by `lstat` is the
file's, the exact one (base64 for binary files, the key) is checked when packing."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import pathspec

MIB = 1024 * 1024
CONFIGMAP_BYTES = MIB - 16 * 1024
"""What one ConfigMap carries (keys + values): the API server refuses more than 1 MiB."""
MAX_CONFIGMAPS = 4
MAX_FILES = 256
"""Each file is an item of the pod volume: the job and every pod spec carry the list."""
NEVER = ".git"
DEFAULT_IGNORES = (".*", "__pycache__/")
IGNORE_FILES = (".gitignore", ".rlhfignore")
CREDENTIAL_NAMES = re.compile(
    r"^(credentials(\..*)?|\.env|\.env\..*|id_[a-z0-9_]+|.*\.(pem|key|p12|pfx|jks|keystore)|[._]netrc|\.npmrc"
    r"|\.pypirc|\.git-credentials|\.dockercfg|.*(^|[^a-z])(token|secrets?|passwords?)([^a-z].*)?)$", re.IGNORECASE)
"""File names that hold credentials (`token` as a word: `hf_token`, not `tokenizer.json`)."""
CREDENTIAL_DIRS = (".aws", ".ssh", ".gnupg", ".docker", ".kube")
PRIVATE_KEY = re.compile(rb"^(-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----|PuTTY-User-Key-File-)", re.MULTILINE)
_KIND = {stat.S_IFIFO: "a fifo", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device"}


class WorkdirError(ValueError):
    """The working directory cannot go to the cluster as given; the message says why and what to do."""


@dataclass(frozen=True)
class Selection:
    """What a user chose beyond the ignore files: `--exclude` and `--include-secret`."""
    excludes: tuple[str, ...] = ()
    include_secrets: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    path: str
    """Relative to the working directory, with `/`."""
    source: Path
    """What is read: the file, or the target of a link inside the directory."""
    size: int
    inode: tuple[int, int]
    """(st_dev, st_ino) of `source` when scanned: what is read must be the same file."""
    link: str | None = None
    """For a link: its target, relative to the directory."""


@dataclass
class Scan:
    entries: list[Entry] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    """Path -> the rule that left it out, as `.gitignore:3 'data/'` (a directory stands for what is under it)."""
    skipped: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def human(n: float) -> str:
    """A byte count as people read it: `784 B`, `3.2 KiB`, `5.1 MiB`, `1.4 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


class _Rules:
    """The ignore layers in force in one directory, lowest first: (base, origin, spec)."""

    def __init__(self, layers: list[tuple[str, str, pathspec.GitIgnoreSpec]]):
        self.layers = layers

    def why_left_out(self, rel: str, is_dir: bool) -> str | None:
        """The rule that leaves `rel` out (`.gitignore:3`, `--exclude '*.bin'`), or None: the last match wins."""
        verdict = None
        for base, origin, spec in self.layers:
            if base and not rel.startswith(base + "/"):
                continue
            result = spec.check_file(rel[len(base) + 1 if base else 0:] + ("/" if is_dir else ""))
            if result.include is not None and result.index is not None:
                pattern = spec.patterns[result.index].pattern
                named = f"{origin}:{result.index + 1}" if origin in IGNORE_FILES or "/" in origin else origin
                verdict = f"{named} {pattern!r}" if result.include else None
        return verdict

    def within(self, directory: Path, rel: str) -> _Rules:
        """These rules and the ignore files of `directory` (at `rel`), still before `--exclude`."""
        added = []
        for name in IGNORE_FILES:
            path = directory / name
            if path.is_file() and not path.is_symlink():
                shown = f"{rel}/{name}" if rel else name
                lines = _read(path, MIB, shown).decode("utf-8", "replace").splitlines()
                added.append((rel, shown, pathspec.GitIgnoreSpec.from_lines(lines)))
        return _Rules(self.layers[:-1] + added + self.layers[-1:]) if added else self


def _read(path: Path, cap: int, rel: str, inode: tuple[int, int] | None = None) -> bytes:
    """At most `cap` bytes of a regular file, through one descriptor (never a link, never
    blocking), and only if it is still the file `inode` names."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap or inode not in (None, (st.st_dev, st.st_ino)):
            raise WorkdirError(f"{rel}: not the regular file of at most {human(cap)} it was (did it change?); "
                               "submit again")
        data = f.read(cap + 1)
    if len(data) > cap:
        raise WorkdirError(f"{rel}: grew past {human(cap)} while it was read")
    return data


def _credential(rel: str) -> bool:
    parts = rel.split("/")
    return (bool(CREDENTIAL_NAMES.match(parts[-1])) or parts[-1] == "kubeconfig"
            or any(p in CREDENTIAL_DIRS for p in parts[:-1]))


def scan(root: Path, selection: Selection = Selection()) -> Scan:
    """The entries of `root` that go, and what was left out, skipped or is refused (not read yet)."""
    if not root.is_dir():
        raise WorkdirError(f"--working-dir {root}: not a directory")
    rules = _Rules([("", "default", pathspec.GitIgnoreSpec.from_lines(DEFAULT_IGNORES)),
                    ("", "--exclude", pathspec.GitIgnoreSpec.from_lines(selection.excludes))])
    out = Scan()
    _walk(root.resolve(), root.resolve(), "", rules, out)
    return out


def _walk(root: Path, directory: Path, rel_dir: str, rules: _Rules, out: Scan) -> None:
    try:
        rules = rules.within(directory, rel_dir)
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as err:
        out.problems.append(f"{rel_dir or '.'}: cannot be read ({err.strerror}); fix its permissions or leave it out")
        return
    for entry in entries:
        rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
        st = entry.stat(follow_symlinks=False)
        is_dir = stat.S_ISDIR(st.st_mode)
        why = "git's own directory, never sent" if entry.name == NEVER else rules.why_left_out(rel, is_dir)
        if why:
            out.left_out[rel] = why
        elif is_dir:
            _walk(root, Path(entry.path), rel, rules, out)
        elif stat.S_ISLNK(st.st_mode):
            _link(root, Path(entry.path), rel, out)
        elif stat.S_ISREG(st.st_mode):
            out.entries.append(Entry(rel, Path(entry.path), st.st_size, (st.st_dev, st.st_ino)))
        else:
            out.skipped.append(f"{rel} ({_KIND.get(stat.S_IFMT(st.st_mode), 'not a regular file')}: not read)")


def _link(root: Path, path: Path, rel: str, out: Scan) -> None:
    target = Path(os.path.realpath(path))
    shown = os.readlink(path)
    where = ("leaves the directory" if not target.is_relative_to(root)
             else f"points into {NEVER}, which is never sent" if NEVER in target.relative_to(root).parts
             else "points to nothing" if not target.exists() else None)
    if where:
        out.problems.append(f"{rel} -> {shown} {where} ({target}): links are sent only when they point to a file "
                            f"inside it; copy the file in, or leave the link out (--exclude {rel})")
        return
    st = target.stat()
    if stat.S_ISDIR(st.st_mode):
        out.skipped.append(f"{rel} -> {shown} (a link to a directory: not followed)")
    elif not stat.S_ISREG(st.st_mode):
        out.skipped.append(f"{rel} -> {shown} ({_KIND.get(stat.S_IFMT(st.st_mode), 'not a regular file')}: not read)")
    else:
        out.entries.append(Entry(rel, target, st.st_size, (st.st_dev, st.st_ino),
                                 target.relative_to(root).as_posix()))


def too_large(sizes: dict[str, int], why: str) -> str:
    """Refused for its size: the numbers, and what to do instead."""
    largest = max(sizes, key=lambda path: sizes[path])
    return (f"{len(sizes)} files, {human(sum(sizes.values()))} in all (largest: {largest}, {human(sizes[largest])}); "
            f"{why}. "
            f"A job carries at most {MAX_FILES} files in {MAX_CONFIGMAPS} ConfigMaps of {human(CONFIGMAP_BYTES)} "
            "(the API server's limit for one ConfigMap is 1 MiB). Put large files (datasets, models) on a volume "
            "(spec.pod.volumes, e.g. a PersistentVolumeClaim, named by their path there) or into the image, leave "
            "them out (--exclude PATTERN, .rlhfignore or .gitignore), and pass a working directory with only code "
            "and small files")


def size_problem(entries: list[Entry]) -> str | None:
    """What breaks the caps, by the sizes `lstat` gave: nothing has been read yet."""
    sizes = {e.path: e.size for e in entries}
    if len(entries) > MAX_FILES:
        return too_large(sizes, f"more than {MAX_FILES} files")
    for e in entries:
        if e.size > CONFIGMAP_BYTES:
            return too_large(sizes, f"{e.path} alone does not fit in one ConfigMap")
    if sum(e.size for e in entries) > MAX_CONFIGMAPS * CONFIGMAP_BYTES:
        return too_large(sizes, f"that needs more than {MAX_CONFIGMAPS} ConfigMaps")
    return None


def credential_problems(entries: Iterable[Entry], read: dict[str, bytes] | None = None) -> list[str]:
    """The entries that look like credentials: by name (before reading) or by content (`read`)."""
    out = []
    for e in entries:
        if read is None and (_credential(e.path) or (e.link is not None and _credential(e.link))):
            why = "its name" if _credential(e.path) else f"its target {e.link}"
        elif read is not None and PRIVATE_KEY.search(read[e.path]):
            why = "a private key inside"
        else:
            continue
        out.append(f"{e.path} looks like a credential ({why}): leave it out (--exclude, .rlhfignore or .gitignore; "
                   f"pods read secrets from a Kubernetes Secret) or send it on purpose: --include-secret {e.path}")
    return out


def _refuse(label: str, problems: list[str]) -> None:
    if problems:
        raise WorkdirError(f"--working-dir {label}: nothing sent:" + "".join(f"\n  - {p}" for p in problems))


def select(root: Path, label: str, selection: Selection = Selection()) -> tuple[Scan, dict[str, bytes]]:
    """The scan of `root` and the bytes of each entry; a `WorkdirError` naming every refused entry.
    Links, names and sizes are refused before any file is read."""
    found = scan(root, selection)
    named = {os.path.normpath(p).replace(os.sep, "/") for p in selection.include_secrets}
    unknown = named - {e.path for e in found.entries}
    if unknown:
        raise WorkdirError(f"--include-secret {', '.join(sorted(unknown))}: no such file is sent from {label} "
                           "(name it relative to the directory, as the list of files sent shows it)")
    unchecked = [e for e in found.entries if e.path not in named]
    size = size_problem(found.entries) if found.entries else None
    _refuse(label, found.problems + credential_problems(unchecked) + ([size] if size else []))
    data, unreadable = {}, []
    for e in found.entries:
        try:
            data[e.path] = _read(e.source, CONFIGMAP_BYTES, e.path, e.inode)
        except OSError as err:
            unreadable.append(f"{e.path}: cannot be read ({err.strerror}); fix its permissions or leave it out")
    _refuse(label, unreadable or credential_problems(unchecked, data))
    return found, data


def listing(label: str, found: Scan, where: str) -> list[str]:
    """What is sent (each path and size, the total), then what was skipped and how much was left out."""
    total = sum(e.size for e in found.entries)
    lines = [f"--working-dir {label}: sending {len(found.entries)} files, {human(total)} in all, in {where}:"]
    lines += [f"  {human(e.size):>10}  {e.path}" + (f" (-> {e.link})" if e.link else "") for e in found.entries]
    lines += [f"  skipped     {s}" for s in found.skipped]
    if found.left_out:
        names = sorted(found.left_out)
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        lines.append(f"  left out    {', '.join(names[:8])}{more} (.git, hidden, __pycache__, .gitignore, "
                     ".rlhfignore, --exclude)")
    return lines
