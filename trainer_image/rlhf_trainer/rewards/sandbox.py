"""Run untrusted Python (model-written code) in a locked-down child process.

`run_python(code, stdin, timeout_s=...)` writes `code` to a fresh scratch directory and runs
it with `python -I` in a new session, then deletes the directory. Barriers (`isolation()` says
which ones this host supports; `SandboxResult.barriers` lists those a run used):

  netns     a new, empty network namespace (`unshare(CLONE_NEWNET)`): not even loopback is up,
            so no socket can reach the trainer, the cluster or the internet.
  mountns   a new mount namespace with fresh small tmpfs over /tmp, /var/tmp and /dev/shm,
            so the world-writable directories the host shares are out of reach, and the
            scratch directory itself a tmpfs of `max_file_mb`, so the disk cannot be filled.
  pidns     a new PID namespace whose init is the program: when it ends or is killed, the
            kernel kills and reaps everything it started (also children that called setsid),
            so no orphan or zombie is left to a PID 1 that may not reap (a trainer running as
            a container's PID 1 does not). A root "relay" process outside the namespace waits
            for it and mirrors its exit status to the trainer.
  uid       as root, the child runs as an unprivileged uid of its own (one per concurrent run,
            `UID_BASE` + slot, reserved across processes with a lock file), group the same
            number, no supplementary groups, `PR_SET_NO_NEW_PRIVS`: the filesystem protects
            the trainer's files and /proc/<trainer>/environ, and at the end every process of
            the run is killed at once with `kill(-1)` sent from that uid.
  rlimits   RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_NPROC (per uid: a fork bomb is bounded),
            RLIMIT_FSIZE (also caps captured stdout/stderr), RLIMIT_NOFILE, RLIMIT_CORE=0.
  env       an empty environment apart from PATH, LANG, PYTHONIOENCODING and *_NUM_THREADS=1.
  guard     a bootstrap that replaces `socket.socket` before the user code runs (defence in
            depth only: `os.system("curl ...")` walks around it).
The wall-clock timeout kills the whole run (without `uid`: its process group).

As non-root, netns and mountns come from a user namespace where the kernel allows one; there
is no uid switch and no pidns, so the child can read what the trainer's user can read (not
its environment: that is empty, but /proc/<trainer>/environ is readable by the same uid) and
a child that left the process group survives the timeout.
`require_isolation=True` (the default) refuses to run without netns and uid: SandboxError.

A sandbox that cannot run at all (no interpreter, a setrlimit/unshare/setuid failure, a
namespace that worked at probe time failing later) raises `SandboxError`; it never reports a
0 reward in disguise. What the program does (crash, timeout, memory error) is a result.
Inside the PID namespace the program is PID 1: signals it sends itself without a handler
are ignored, and so is SIGXFSZ (a write past RLIMIT_FSIZE fails with EFBIG instead).

Not done: seccomp syscall filtering, cgroup accounting (RLIMIT_AS bounds memory per process,
so `max_processes * memory_mb` bounds a run), a read-only view of the host filesystem (files
readable by "other" stay readable; with netns there is no way to send them anywhere).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

UID_BASE = 61000
"""First uid the sandbox runs as (root only); runs in flight use UID_BASE + [0, MAX_SLOTS)."""
MAX_SLOTS = 512
LOCK_DIR = Path(tempfile.gettempdir()) / "rlhf-sandbox-uids"
"""Lock files reserving a uid across trainer processes on one host."""
TMPFS_SIZE = "16m"
"""Size of each private tmpfs (/tmp, /var/tmp, /dev/shm) in the mount namespace."""
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
             "PYTHONIOENCODING": "utf-8",
             # one thread per BLAS/OpenMP pool: threads count against RLIMIT_NPROC and RLIMIT_AS
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_libc = ctypes.CDLL(None, use_errno=True)

BOOTSTRAP = r"""
import builtins, socket, sys
def _no_network(*args, **kwargs):
    raise PermissionError(1, "network access is disabled in the sandbox")
class _NoSocket:
    def __init__(self, *args, **kwargs):
        _no_network()
for _name in ("socket", "SocketType"):
    setattr(socket, _name, _NoSocket)
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(socket, _name, _no_network)
import _socket
_socket.socket = _socket.SocketType = _NoSocket
del _name
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
exec(_code, {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"})
"""


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the program in it)."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    """What the program printed (at most `max_output_bytes`, decoded as UTF-8 with replacement)."""
    stderr: str
    exit_code: int | None
    """Exit status; negative when killed by a signal (-9 on timeout or past cpu_s)."""
    timed_out: bool
    """Killed for running past the wall-clock `timeout_s`."""
    wall_s: float
    output_truncated: bool
    """stdout or stderr went past `max_output_bytes` (or the file size limit killed it)."""
    barriers: tuple[str, ...]
    """The barriers this run used (see the module docstring)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox do, probed once per process."""
    python: str
    """The interpreter the sandbox runs (readable and executable by the sandbox uid)."""
    netns: bool
    mountns: bool
    pidns: bool
    uid: bool

    @property
    def barriers(self) -> tuple[str, ...]:
        names = [n for n in ("netns", "mountns", "pidns", "uid") if getattr(self, n)]
        return (*names, "rlimits", "env", "guard")


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _world_executable(path: str) -> bool:
    """True when a uid with no relation to the owner can execute `path` (every directory o+x)."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & 0o005 == 0o005:
            return False
        return all(p.stat().st_mode & 0o001 for p in real.parents)
    except OSError:
        return False


def _pick_python(switch_uid: bool) -> str:
    candidates = [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
    for candidate in candidates:
        if candidate and os.path.exists(candidate) and (not switch_uid
                                                        or _world_executable(candidate)):
            return candidate
    raise SandboxError("no Python interpreter the sandbox uid may run: tried "
                       + ", ".join(filter(None, candidates))
                       + " (each directory on the path needs o+x, the file o+rx)")


def _relay_child(pid: int) -> None:
    """The root process outside the PID namespace: wait for its init, mirror how it ended.

    Never returns. It holds no file descriptors, so Popen's exec check completes at once.
    """
    os.closerange(0, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    code = 255
    try:
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            os.kill(os.getpid(), -code)  # default action for most signals: die the same way
            code = 128 - code
    finally:
        os._exit(code)


def _make_preexec(*, netns: bool, mountns: bool, pidns: bool, uid: int | None,
                  limits: dict[int, int], err_fd: int | None, scratch: str = "/",
                  scratch_mb: int = 16):
    """The function the child runs between fork and exec (cwd: `scratch`, which holds
    main.py). It must stay small: the trainer has threads."""
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    scratch_opts = f"size={scratch_mb}m,mode=0700{owner}".encode()
    scratch = scratch.encode()
    flags = ((CLONE_NEWNET if netns else 0) | (CLONE_NEWNS if mountns else 0)
             | (CLONE_NEWPID if pidns else 0))
    if flags and uid is None:
        flags |= CLONE_NEWUSER  # unprivileged: namespaces only inside a user namespace
    tmp_dirs = [d.encode() for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.isdir(d)]
    tmpfs_opts = f"size={TMPFS_SIZE},mode=1777".encode()

    def preexec() -> None:
        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if flags:
                ids = os.getuid(), os.getgid()
                _check(_libc.unshare(flags), "unshare")
                if flags & CLONE_NEWUSER:  # keep our own ids inside (files on tmpfs need them)
                    for name, text in (("setgroups", "deny"), ("uid_map", f"{ids[0]} {ids[0]} 1"),
                                       ("gid_map", f"{ids[1]} {ids[1]} 1")):
                        with open(f"/proc/self/{name}", "w") as f:
                            f.write(text)
            if mountns:
                _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None),
                       "make / private")
                # the scratch directory becomes a tmpfs of its own: a bounded disk
                with open("main.py", "rb") as f:
                    program = f.read()
                _check(_libc.mount(b"tmpfs", scratch, b"tmpfs", MS_NOSUID | MS_NODEV,
                                   scratch_opts), "mount tmpfs on the scratch directory")
                os.chdir(scratch)
                with open("main.py", "wb") as f:
                    f.write(program)
                if uid is not None:
                    os.chown("main.py", uid, uid)
                for d in tmp_dirs:  # the cwd (scratch dir) stays reachable: it is open
                    _check(_libc.mount(b"tmpfs", d, b"tmpfs", MS_NOSUID | MS_NODEV, tmpfs_opts),
                           "mount tmpfs on " + d.decode())
            if pidns:  # the next child is PID 1 of the new namespace: it goes on to exec
                child = os.fork()
                if child:
                    _relay_child(child)
            for res, value in limits.items():
                resource.setrlimit(res, (value, value))
            if uid is not None:
                try:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)
                except OSError as err:
                    raise OSError(err.errno, f"switch to uid {uid}: {err.strerror}") from None
            _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        except BaseException as err:
            if err_fd is not None:
                os.write(err_fd, f"{type(err).__name__}: {err}".encode()[:1000])
            raise

    return preexec


class _UidSlot:
    """Reserves one uid for a run: in-process set plus a flock'ed file for other processes."""
    _lock = threading.Lock()
    _taken: set[int] = set()

    def __init__(self) -> None:
        self.uid: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> int:
        LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        for uid in range(UID_BASE, UID_BASE + MAX_SLOTS):
            with self._lock:
                if uid in self._taken:
                    continue
                self._taken.add(uid)
            fd = os.open(LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                with self._lock:
                    self._taken.discard(uid)
                continue
            self.uid, self._fd = uid, fd
            return uid
        raise SandboxError(f"all {MAX_SLOTS} sandbox uids from {UID_BASE} are in use")

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
        with self._lock:
            self._taken.discard(self.uid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` at once: kill(-1) from a child that became `uid`."""
    pid = os.fork()
    if pid == 0:  # only async-signal-safe work here
        code = 1
        try:
            os.setgid(uid)
            os.setuid(uid)
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SandboxError(f"could not kill the processes of sandbox uid {uid}")


def _make_scratch(code: str, uid: int | None) -> Path:
    """A fresh 0700 directory holding main.py, owned by the sandbox uid."""
    scratch = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
    (scratch / "main.py").write_text(code, encoding="utf-8")
    if uid is not None:
        for p in (scratch, scratch / "main.py"):
            os.chown(p, uid, uid)
    return scratch


def _probe_run(python: str, *, netns: bool = False, mountns: bool = False, pidns: bool = False,
               uid: int | None) -> bool:
    scratch = _make_scratch("", uid)
    try:
        proc = subprocess.run([python, "-I", "-c", BOOTSTRAP], env=CHILD_ENV, cwd=scratch,
                              preexec_fn=_make_preexec(netns=netns, mountns=mountns, pidns=pidns,
                                                       uid=uid, limits={}, err_fd=None,
                                                       scratch=str(scratch)),
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60)
    except (subprocess.SubprocessError, OSError):
        return False
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return proc.returncode == 0


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once which barriers work here (a few short child processes)."""
    root = os.geteuid() == 0
    python = _pick_python(root)
    uid = None
    with _UidSlot() if root else _NoSlot() as slot:
        if root and _probe_run(python, uid=slot):
            uid = slot
        if not _probe_run(python, uid=uid):
            raise SandboxError(f"the sandbox cannot start {python} even without namespaces")
        netns = _probe_run(python, netns=True, uid=uid)
        mountns = netns and _probe_run(python, netns=True, mountns=True, uid=uid)
        # a PID namespace only with a uid of its own: the relay must stay unkillable by it
        pidns = uid is not None and _probe_run(python, netns=netns, mountns=mountns, pidns=True,
                                               uid=uid)
    return Isolation(python=python, netns=netns, mountns=mountns, pidns=pidns, uid=uid is not None)


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def run_python(code: str, stdin: str = "", *, timeout_s: float = 10.0, memory_mb: int = 512,
               max_processes: int = 16, max_file_mb: int = 16, cpu_s: int | None = None,
               max_output_bytes: int = 1 << 20, require_isolation: bool = True) -> SandboxResult:
    """Run `code` with `stdin` under the barriers above; see SandboxResult.

    `cpu_s` defaults to ceil(timeout_s) + 1; `max_processes` counts threads too (RLIMIT_NPROC);
    `max_file_mb` bounds each file written (and captured stdout/stderr) and, with mountns,
    the whole scratch directory, which is then a tmpfs of that size.
    """
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb),
                        ("max_processes", max_processes), ("max_file_mb", max_file_mb),
                        ("max_output_bytes", max_output_bytes)):
        if not value > 0:
            raise ValueError(f"sandbox {name} must be positive, got {value}")
    iso = isolation()
    if require_isolation and not (iso.netns and iso.uid):
        raise SandboxError(
            "the code sandbox needs a network namespace and a uid switch (run the trainer as "
            f"root with CAP_SYS_ADMIN); this host gives netns={iso.netns}, uid={iso.uid}. "
            "Pass require_isolation=False to run with what it has: " + ", ".join(iso.barriers))
    cpu = int(cpu_s if cpu_s is not None else -(-timeout_s // 1) + 1)
    limits = {resource.RLIMIT_AS: memory_mb << 20, resource.RLIMIT_CPU: cpu,
              resource.RLIMIT_NPROC: max_processes, resource.RLIMIT_FSIZE: max_file_mb << 20,
              resource.RLIMIT_NOFILE: 64, resource.RLIMIT_CORE: 0}
    barriers = iso.barriers
    with _UidSlot() if iso.uid else _NoSlot() as uid, \
            tempfile.TemporaryDirectory(prefix="rlhf-sandbox-io-") as io_dir:
        scratch = _make_scratch(code, uid)
        try:
            io = Path(io_dir)
            (io / "stdin").write_text(stdin, encoding="utf-8")
            err_r, err_w = os.pipe()
            try:
                with open(io / "stdin", "rb") as fin, open(io / "stdout", "wb") as fout, \
                        open(io / "stderr", "wb") as ferr:
                    start = time.monotonic()
                    try:
                        proc = subprocess.Popen(
                            [iso.python, "-I", "-c", BOOTSTRAP], cwd=scratch, env=CHILD_ENV,
                            stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
                            preexec_fn=_make_preexec(netns=iso.netns, mountns=iso.mountns,
                                                     pidns=iso.pidns, uid=uid, limits=limits,
                                                     err_fd=err_w, scratch=str(scratch),
                                                     scratch_mb=max_file_mb))
                    except (OSError, subprocess.SubprocessError) as err:
                        os.close(err_w)
                        err_w = -1
                        detail = os.read(err_r, 1000).decode(errors="replace")
                        raise SandboxError(f"the sandbox could not start: {err}"
                                           + (f" ({detail})" if detail else "")) from err
                    timed_out = False
                    try:
                        proc.wait(timeout=timeout_s)
                    except subprocess.TimeoutExpired:
                        timed_out = True
                    finally:
                        if uid is not None:  # all of the run; the root relay stays to reap
                            _kill_uid(uid)
                        else:
                            _kill_group(proc.pid)
                        proc.wait()
                    wall_s = time.monotonic() - start
            finally:
                os.close(err_r)
                if err_w >= 0:
                    os.close(err_w)
            stdout, cut_out = _read_capped(io / "stdout", max_output_bytes)
            stderr, cut_err = _read_capped(io / "stderr", max_output_bytes)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    exit_code = proc.returncode
    truncated = cut_out or cut_err or exit_code == -signal.SIGXFSZ
    return SandboxResult(stdout, stderr, exit_code, timed_out, wall_s, truncated, barriers)


class _NoSlot:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    except OSError as err:
        if err.errno != errno.ESRCH:
            raise


def default_num_workers() -> int:
    """Parallel sandboxes by default: one per core, at least 2."""
    return max(2, os.cpu_count() or 1)


def run_many(jobs: Sequence[tuple[str, str]], *, max_workers: int | None = None,
             **kwargs) -> list[SandboxResult]:
    """`run_python(code, stdin, **kwargs)` for each (code, stdin), `max_workers` at a time,
    results in input order. A SandboxError in any run is raised."""
    if not jobs:
        return []
    workers = min(len(jobs), max_workers or default_num_workers())
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_python(job[0], job[1], **kwargs), jobs))
