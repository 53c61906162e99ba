"""Run untrusted Python (model-written code) where it can neither cheat, escape nor stall.

`run_python(code, stdin, limits)` runs one program on one input and returns a
`SandboxResult`; `run_many(jobs, limits)` runs many through ONE bounded queue.

Backends (`isolation()` probes once which one this host allows):

  bwrap    bubblewrap (https://github.com/containers/bubblewrap), as any user: it needs
           unprivileged user namespaces, not root and not a capability. Each run gets a new
           user, PID, network, mount, IPC, UTS and cgroup namespace and a FRESH root filesystem
           view that holds only /usr (read-only), a new /proc that shows only the run's own
           processes, a minimal /dev, and one private tmpfs of `tmpfs_mb` at /tmp (the working
           directory, holding main.py). The trainer's files (data with test outputs, checkpoints,
           the mounted service-account token), its processes and its network are simply not
           there: nothing to read, signal or connect to. `kill(-1)` reaches only the run's own
           processes. The program runs as uid 65534 inside, with no capabilities and no way to
           create further user namespaces (`--disable-userns`), so it cannot mount anything.
           When the run ends or is killed, its PID namespace goes with it (every process of the
           run, also those that called setsid).
  rlimits  resource limits and a process group only (no namespaces): for hosts whose kernel or
           seccomp profile forbids user namespaces, e.g. a pod at the `restricted` level with the
           RuntimeDefault seccomp profile. Safe only where the POD is the barrier, i.e. the
           sandbox service pod that the operator creates (no token, no data, no egress, its own
           PID namespace), never in the trainer's pod: only a sandbox service started with
           `--allow-rlimits-only` runs it (`RLIMITS_ONLY_ALLOWED`), and only for requests with
           `require_isolation=False`. Runs go one at a time (same-uid runs could otherwise read
           each other's output), and as PID 1 the service kills every leftover process before
           the next run. Programs cannot start processes or threads there (RLIMIT_NPROC counts
           all processes of the pod's uid), and the pod's disk (emptyDir) is shared by runs.

Why bubblewrap: it is the smallest tool that builds a whole per-run root filesystem, /proc and
network namespace from unprivileged user namespaces (Flatpak's sandbox, packaged by Debian, 72 kB,
no daemon, no config file); nsjail would add seccomp policies and cgroups but is a build from
source with protobuf; a remote sandbox (SandboxFusion and the like) moves the same problem into
another service. We use bubblewrap in both places: in the trainer's process tree (local mode)
and in the sandbox service pods the operator creates (cluster).

As root, bwrap itself runs as uid 65534 (`SANDBOX_UID`): the kernel does not apply RLIMIT_NPROC
to a user namespace made by root, so a fork bomb would be unbounded; as nobody it is exactly the
unprivileged case, which is also what a trainer pod (uid 1000, no capabilities) runs.

Limits per run (`Limits`): wall time (the whole run is killed), CPU seconds, memory, processes
(threads count), file size and captured output, open files. Memory: RLIMIT_AS bounds each
process and RLIMIT_NPROC the number of processes of the run (counted per user namespace, so per
run, with bwrap), and the only writable space is the tmpfs of `tmpfs_mb`; a run therefore never
holds more than `Limits.memory_bound_mb` = max_processes * memory_mb + tmpfs_mb, and the queue
admits only as many runs as fit the memory the process may use (cgroup limit).

Concurrency: ONE queue per process (`capacity()` runs at once, from the CPUs this process may
use: cgroup CPU quota and CPU affinity, never the host's core count, and from the cgroup memory
limit divided by the memory bound of a run). A caller that finds it full waits; it never fails.

A sandbox that cannot run at all (no bubblewrap, no interpreter, the namespace setup failing)
raises `SandboxError`; it never reports a 0 reward in disguise. What the program does (crash,
timeout, memory error, output flood) is a result.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

BWRAP_ENV = "RLHF_BWRAP"
"""Path of the bwrap binary; otherwise PATH, then the cache that `make test` fills."""
BWRAP_CACHE = Path.home() / ".cache" / "rlhf-operator" / "bubblewrap" / "usr" / "bin" / "bwrap"
CONCURRENCY_ENV = "RLHF_SANDBOX_CONCURRENCY"
"""Overrides `capacity()` (runs at once in this process)."""
SANDBOX_UID = 65534
"""The uid (and gid) a program has inside its user namespace (nobody)."""
CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp",
             "TMPDIR": "/tmp", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
             # one thread per BLAS/OpenMP pool: threads count against RLIMIT_NPROC and RLIMIT_AS
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

# Runs inside the sandbox: lower the limits (after the user namespace exists, so RLIMIT_NPROC
# counts this run's processes only), say "started" on the fd argv[2] and close it (so the
# program cannot fake a sandbox failure, nor a start), then run main.py as __main__.
# argv[1]: limits as JSON.
BOOTSTRAP = r"""
import builtins, json, os, resource, sys
for _name, _value in json.loads(sys.argv[1]).items():
    _res = getattr(resource, _name)
    resource.setrlimit(_res, (_value, _value))
os.write(int(sys.argv[2]), b"1")
os.close(int(sys.argv[2]))
import socket, _socket
def _no_network(*args, **kwargs):
    raise PermissionError(1, "network access is disabled in the sandbox")
class _NoSocket:
    def __init__(self, *args, **kwargs):
        _no_network()
for _mod in (socket, _socket):
    _mod.socket = _mod.SocketType = _NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(socket, _name, _no_network)
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f, _name, _value, _res, _mod
exec(_code, {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"})
"""


START_RETRIES = 2
"""A bwrap sandbox that fails to start is retried this often (0.5 s, then 2 s apart)."""
RLIMITS_ONLY_ALLOWED = False
"""Set by the sandbox service started with --allow-rlimits-only (its pod is the barrier). In any
other process, the trainer's above all, the rlimits backend never runs model code."""
_RLIMITS_ONE_AT_A_TIME = threading.Lock()
SPAWN_LOCK = threading.Lock()
LIVE_PIDS: set[int] = set()
"""Pids of the runs' direct children, registered under SPAWN_LOCK until they are reaped (a PID 1
that reaps orphans must leave these to their Popen)."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the program in it)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits. Every field is checked to be positive."""
    timeout_s: float = 10.0
    """Wall clock; past it every process of the run is killed."""
    memory_mb: int = 512
    """Address space of each process (RLIMIT_AS)."""
    max_processes: int = 4
    """Processes and threads of the run together (RLIMIT_NPROC, per user namespace)."""
    tmpfs_mb: int = 64
    """The run's only writable space (/tmp, its working directory); also caps each file."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr are each cut here; a run that goes past it is not `ok`."""
    cpu_s: int | None = None
    """CPU seconds per process; default ceil(timeout_s) + 1."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_processes", "tmpfs_mb", "max_output_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"sandbox limit {name} must be a positive number, got {value!r}")
        if self.cpu_s is not None and not self.cpu_s > 0:
            raise ValueError(f"sandbox limit cpu_s must be positive, got {self.cpu_s!r}")

    @property
    def memory_bound_mb(self) -> int:
        """The most memory one run can hold: every process at its limit, plus a full tmpfs."""
        return self.max_processes * self.memory_mb + self.tmpfs_mb

    def rlimits(self, extra_processes: int = 0) -> dict[str, int]:
        cpu = int(self.cpu_s if self.cpu_s is not None else -(-self.timeout_s // 1) + 1)
        return {"RLIMIT_AS": self.memory_mb << 20, "RLIMIT_CPU": cpu,
                "RLIMIT_NPROC": self.max_processes + extra_processes,
                "RLIMIT_FSIZE": max(self.tmpfs_mb << 20, self.max_output_bytes + 1),
                "RLIMIT_NOFILE": 64, "RLIMIT_CORE": 0}

    def to_json(self) -> dict:
        return asdict(self)


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
    """stdout or stderr went past `max_output_bytes` (or the file size limit stopped it)."""
    backend: str
    """"bwrap" or "rlimits" (see the module docstring)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "SandboxResult":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox do, probed once per process."""
    backend: str
    """"bwrap" (per-run namespaces) or "rlimits"."""
    python: str
    """The interpreter programs run with."""
    bwrap: str | None
    """The bwrap binary, when found."""
    reason: str = ""
    """Why bwrap is not used, when it is not."""
    mounts: tuple[str, ...] = field(default=())
    """Host directories bound read-only into each run (bwrap)."""


def find_bwrap() -> str | None:
    for candidate in (os.environ.get(BWRAP_ENV), shutil.which("bwrap"), str(BWRAP_CACHE)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _pick_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxError("no Python interpreter for the sandbox: tried /usr/bin/python3, "
                       f"/usr/local/bin/python3, {sys.executable}")


def _mounts(python: str) -> tuple[str, ...]:
    """Read-only host directories a run needs: /usr, plus the interpreter's prefix if elsewhere."""
    mounts = ["/usr"]
    prefix = Path(os.path.realpath(python)).parent.parent
    if not str(prefix).startswith("/usr/") and str(prefix) != "/usr":
        mounts.append(str(prefix))
    return tuple(mounts)


def _bwrap_argv(iso: Isolation, rlimits: dict[str, int], tmpfs_mb: int, code_fd: int,
                started_fd: int) -> list[str]:
    argv = [iso.bwrap, "--unshare-user", "--unshare-all", "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_UID), "--disable-userns", "--die-with-parent", "--new-session"]
    for mount in iso.mounts:
        argv += ["--ro-bind", mount, mount]
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):  # merged-/usr symlinks, or real dirs
        host = Path("/") / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            argv += ["--ro-bind", str(host), str(host)]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
             "--size", str(tmpfs_mb << 20), "--perms", "1777", "--tmpfs", "/tmp",
             "--perms", "0444", "--ro-bind-data", str(code_fd), "/tmp/main.py",
             "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for key, value in CHILD_ENV.items():
        argv += ["--setenv", key, value]
    return argv + ["--", iso.python, "-I", "-S", "-c", BOOTSTRAP, json.dumps(rlimits),
                   str(started_fd)]


def _rlimits_argv(iso: Isolation, rlimits: dict[str, int], started_fd: int) -> list[str]:
    return [iso.python, "-I", "-S", "-c", BOOTSTRAP, json.dumps(rlimits), str(started_fd)]


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(iso: Isolation, code: str, stdin: str, limits: Limits) -> SandboxResult:
    """One run, no queueing (see run_python)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as io_dir:
        io = Path(io_dir)  # 0700, ours: stdin and captured output never visible to the run
        (io / "stdin").write_text(stdin, encoding="utf-8")
        started_r, started_w = os.pipe()
        pass_fds: tuple[int, ...] = (started_w,)
        code_fd = bwrap_fd = -1
        user: dict = {}
        if iso.backend == "bwrap":
            code_fd = os.memfd_create("main.py")
            os.write(code_fd, code.encode("utf-8"))
            os.lseek(code_fd, 0, os.SEEK_SET)
            pass_fds += (code_fd,)
            # bwrap's own init is PID 1 of the run: one more process in the run's count
            argv = _bwrap_argv(iso, limits.rlimits(extra_processes=1), limits.tmpfs_mb, code_fd,
                               started_w)
            cwd = "/"
            if os.geteuid() == 0:
                # As root the kernel does not apply RLIMIT_NPROC in the run's user namespace
                # (a fork bomb is unbounded), so bwrap runs as `nobody`, exactly as it does
                # for an unprivileged trainer; exec'd through its fd, because its directory
                # (e.g. under /root) may be closed to that uid.
                bwrap_fd = os.open(iso.bwrap, os.O_RDONLY)
                pass_fds += (bwrap_fd,)
                argv[0] = f"/proc/self/fd/{bwrap_fd}"
                user = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
        else:
            scratch = io / "scratch"
            scratch.mkdir()
            (scratch / "main.py").write_text(code, encoding="utf-8")
            argv, cwd = _rlimits_argv(iso, limits.rlimits(), started_w), str(scratch)
        try:
            with open(io / "stdin", "rb") as fin, open(io / "stdout", "wb") as fout, \
                    open(io / "stderr", "wb") as ferr:
                start = time.monotonic()
                try:
                    with SPAWN_LOCK:
                        proc = subprocess.Popen(argv, cwd=cwd, env=CHILD_ENV, stdin=fin,
                                                stdout=fout, stderr=ferr, pass_fds=pass_fds,
                                                start_new_session=True, **user)
                        LIVE_PIDS.add(proc.pid)
                except OSError as err:
                    raise SandboxError(f"the sandbox could not start {argv[0]}: {err}") from err
                os.close(started_w)
                started_w = -1
                timed_out = False
                try:
                    proc.wait(timeout=limits.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    # bwrap: killing it kills the run's PID 1 (die-with-parent) and with it the
                    # whole PID namespace; rlimits: the process group
                    _kill_group(proc.pid)
                    proc.wait()
                    with SPAWN_LOCK:
                        LIVE_PIDS.discard(proc.pid)
                wall_s = time.monotonic() - start
            os.set_blocking(started_r, False)
            try:
                started = os.read(started_r, 1) == b"1"
            except BlockingIOError:  # a writer still open but nothing written: never started
                started = False
        finally:
            for fd in (code_fd, bwrap_fd, started_w, started_r):
                if fd >= 0:
                    os.close(fd)
        stdout, cut_out = _read_capped(io / "stdout", limits.max_output_bytes)
        stderr, cut_err = _read_capped(io / "stderr", limits.max_output_bytes)
    exit_code = proc.returncode
    if not started and not timed_out:
        raise SandboxError(f"the sandbox ({iso.backend}) did not start the program: exit "
                           f"{exit_code}, {stderr.strip()[:500]!r}")
    if exit_code is not None and exit_code > 128 and iso.backend == "bwrap":
        exit_code = 128 - exit_code  # bwrap reports a signal death of the program as 128 + n
    truncated = cut_out or cut_err or exit_code == -signal.SIGXFSZ
    return SandboxResult(stdout, stderr, exit_code, timed_out, wall_s, truncated, iso.backend)


@lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Probe once which backend works here (one short run)."""
    python = _pick_python()
    bwrap = find_bwrap()
    if bwrap is None:
        return Isolation("rlimits", python, None,
                         f"no bwrap binary (set {BWRAP_ENV}, put bwrap on PATH, or `make test` "
                         f"fetches it into {BWRAP_CACHE.parent.parent.parent})")
    iso = Isolation("bwrap", python, bwrap, mounts=_mounts(python))
    try:
        probe = _run(iso, "print(6 * 7)", "", Limits(timeout_s=60))
    except SandboxError as err:
        return Isolation("rlimits", python, bwrap, f"bwrap cannot run here: {err}")
    if probe.stdout.strip() != "42":
        return Isolation("rlimits", python, bwrap,
                         f"bwrap probe printed {probe.stdout!r:.200}, stderr {probe.stderr!r:.300}")
    return iso


def available_cpus() -> float:
    """CPUs this process may use: its affinity, cut by the cgroup CPU quota (v2 or v1)."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = _cgroup_cpu_quota()
    return min(cpus, quota) if quota else cpus


def _cgroup_file(v2_name: str, v1_controller: str, v1_name: str) -> str | None:
    """Contents of a cgroup file of this process (v2 first), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / v2_name,
                          Path("/sys/fs/cgroup") / v2_name]
        elif v1_controller in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers
            if not base.exists():
                base = Path("/sys/fs/cgroup") / v1_controller
            candidates = [base / path.lstrip("/") / v1_name, base / v1_name]
        else:
            continue
        for candidate in candidates:
            try:
                return candidate.read_text().strip()
            except OSError:
                continue
    return None


def _cgroup_cpu_quota() -> float | None:
    v2 = _cgroup_file("cpu.max", "cpu", "cpu.cfs_quota_us")
    if v2 and " " in v2:
        quota, period = v2.split()
        return None if quota == "max" else int(quota) / int(period)
    if v2 and int(v2) > 0:
        period = _cgroup_file("", "cpu", "cpu.cfs_period_us")
        return int(v2) / int(period or 100000)
    return None


def cgroup_memory_limit_mb() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max or v1), or None."""
    text = _cgroup_file("memory.max", "memory", "memory.limit_in_bytes")
    if not text or text == "max" or int(text) >= 1 << 60:
        return None
    return int(text) >> 20


def capacity(limits: Limits | None = None) -> int:
    """Runs at once in this process: `RLHF_SANDBOX_CONCURRENCY`, else the CPUs this process
    may use, and no more than its cgroup memory limit holds at `limits.memory_bound_mb` each."""
    if os.environ.get(CONCURRENCY_ENV):
        value = int(os.environ[CONCURRENCY_ENV])
        if value < 1:
            raise ValueError(f"{CONCURRENCY_ENV} must be at least 1, got {value}")
        return value
    n = max(1, int(available_cpus()))
    memory = cgroup_memory_limit_mb()
    if memory and limits is not None:
        n = min(n, max(1, memory // limits.memory_bound_mb))
    return n


class _Queue:
    """The ONE bounded queue of runs in this process: a semaphore waited on, never failed on."""
    _lock = threading.Lock()
    _sem: threading.BoundedSemaphore | None = None
    size = 0

    @classmethod
    def slot(cls, limits: Limits) -> threading.BoundedSemaphore:
        with cls._lock:
            if cls._sem is None:
                cls.size = capacity(limits)
                cls._sem = threading.BoundedSemaphore(cls.size)
            return cls._sem


def run_python(code: str, stdin: str = "", limits: Limits | None = None, *,
               require_isolation: bool = True) -> SandboxResult:
    """Run `code` on `stdin` under `limits` (see the module docstring), waiting for a free
    slot of the queue first. Without the bwrap backend it raises SandboxError, unless
    `require_isolation` is False AND this process is a sandbox service allowed to run with
    resource limits only."""
    limits = limits or Limits()
    iso = isolation()
    if iso.backend != "bwrap" and (require_isolation or not RLIMITS_ONLY_ALLOWED):
        why = ("reward.requireSandboxIsolation is true" if require_isolation else
               "this process is not a sandbox service started with --allow-rlimits-only, and "
               "resource limits alone would leave the trainer's files, processes, token and "
               "network in reach")
        raise SandboxError(
            "the code sandbox needs bubblewrap with unprivileged user namespaces (per-run "
            f"filesystem, /proc and network namespaces), and here: {iso.reason}; {why}. "
            "On a cluster, give the sandbox pods a seccomp profile that allows user namespaces "
            "(sandboxService.seccompLocalhostProfile), or set reward.requireSandboxIsolation: "
            "false to let the sandbox pod (no token, no data, no egress) be the only barrier.")
    if iso.backend != "bwrap":
        # Without namespaces, runs of one uid could read each other's files and /proc (a
        # program could copy a sibling sample's correct output): one run at a time, and as the
        # pod's PID 1 every leftover process of earlier runs is killed before the next starts.
        with _Queue.slot(limits), _RLIMITS_ONE_AT_A_TIME:
            _kill_leftovers()
            return _run(iso, code, stdin, limits)
    with _Queue.slot(limits):
        for attempt in range(START_RETRIES + 1):
            try:
                return _run(iso, code, stdin, limits)
            except SandboxError:
                # a sandbox that did not start (e.g. the kernel short of namespaces for a
                # moment under load) is tried again before the step is failed
                if attempt == START_RETRIES:
                    raise
                time.sleep(0.5 * 4 ** attempt)
    raise AssertionError("unreachable")


def _kill_leftovers() -> None:
    """As PID 1 of a PID namespace (the sandbox pod): SIGKILL every other process in it. Runs
    are over by then, so any process left is a program's orphan. Elsewhere: nothing (it would
    not be ours to kill)."""
    if os.getpid() != 1:
        return
    deadline = time.monotonic() + 30
    while others := [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != 1]:
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {others[:10]} of earlier runs do not die")
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.waitpid(pid, os.WNOHANG)  # reparented to us: reap it (or the reaper does)
            except ChildProcessError:
                pass
        time.sleep(0.01)


def run_many(jobs: Sequence[tuple[str, str]], limits: Limits | None = None, *,
             require_isolation: bool = True) -> list[SandboxResult]:
    """`run_python(code, stdin, limits)` for each (code, stdin), results in input order, at
    most `capacity()` at once in this process (threads wait on the one queue). A SandboxError
    in any run is raised."""
    if not jobs:
        return []
    limits = limits or Limits()
    workers = min(len(jobs), _Queue.slot(limits) and _Queue.size)
    if workers <= 1:
        return [run_python(c, s, limits, require_isolation=require_isolation) for c, s in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_python(job[0], job[1], limits,
                                                    require_isolation=require_isolation), jobs))
