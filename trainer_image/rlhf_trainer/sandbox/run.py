"""Running programs: `run_python(code, stdin, limits)` runs one program on one input and returns
a `SandboxResult`; `run_many(jobs, limits)` runs many through ONE bounded queue per process.

The backend (`isolation()`, probed once with one short run) and its command line come from
`bwrap`; the queue's size from `cgroup.capacity()`. A caller that finds the queue full waits; it
never fails. Each run gets a private 0700 directory of ours for its stdin and captured output,
a pipe on which the bootstrap says it started (so a program cannot fake a sandbox failure), and
is killed as a whole at its wall-clock limit.

A bwrap sandbox that did not start (e.g. the kernel short of namespaces for a moment under load)
is tried again (`START_RETRY`) before the step is failed with SandboxError. With the rlimits
backend (allowed only in a sandbox service started with --allow-rlimits-only, see
`set_rlimits_only_allowed`), runs go one at a time and, as the pod's PID 1, every leftover
process of earlier runs is killed before the next one starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Sequence

from rlhf_trainer.retry import Retry
from rlhf_trainer.sandbox.bwrap import (BWRAP_CACHE, BWRAP_ENV, CHILD_ENV, SANDBOX_UID, Isolation,
                                        bwrap_argv, find_bwrap, host_mounts, pick_python,
                                        rlimits_argv)
from rlhf_trainer.sandbox.cgroup import capacity
from rlhf_trainer.sandbox.limits import Limits, SandboxError, SandboxResult

START_RETRY = Retry(attempts=3, delay_s=0.5, factor=4.0, retry_on=(SandboxError,))
"""A bwrap sandbox that fails to start is tried 3 times in all, 0.5 s then 2 s apart."""
RLIMITS_ONLY_ALLOWED = False
"""Set by the sandbox service started with --allow-rlimits-only (its pod is the barrier), through
`set_rlimits_only_allowed`. In any other process, the trainer's above all, the rlimits backend
never runs model code."""
_RLIMITS_ONE_AT_A_TIME = threading.Lock()
SPAWN_LOCK = threading.Lock()
LIVE_PIDS: set[int] = set()
"""Pids of the runs' direct children, registered under SPAWN_LOCK until they are reaped (a PID 1
that reaps orphans must leave these to their Popen)."""


NPROC_SLACK = 2
"""Tasks the service may start between counting its own and the run's fork (a request thread)."""


def uid_tasks(uid: int | None = None) -> int:
    """Processes and threads of `uid` (default ours) that this process can see: what the
    kernel counts against a run's RLIMIT_NPROC besides the run itself. The rlimits backend
    runs as PID 1 of a pod whose uid is its own (the operator gives each job's sandbox pods a
    uid no other workload has), so what it sees is all there is."""
    uid = os.getuid() if uid is None else uid
    tasks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            tasks += int(fields["Threads"])
    return tasks


def set_rlimits_only_allowed(allowed: bool = True) -> None:
    """Let `run_python(..., require_isolation=False)` use the rlimits backend in this process:
    for the sandbox service alone, whose pod is the barrier."""
    global RLIMITS_ONLY_ALLOWED
    RLIMITS_ONLY_ALLOWED = allowed


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _launch(iso: Isolation, code: str, limits: Limits, io: Path, started_w: int,
            fds: list[int]) -> tuple[list[str], str, tuple[int, ...], dict]:
    """argv, working directory, inherited fds and Popen user arguments of one run. The fds it
    opens are appended to `fds` (the caller closes them)."""
    if iso.backend != "bwrap":
        scratch = io / "scratch"
        scratch.mkdir()
        (scratch / "main.py").write_text(code, encoding="utf-8")
        # RLIMIT_NPROC counts every task of the uid, ours included: the run gets its own on top
        rlimits = limits.rlimits(extra_processes=uid_tasks() + NPROC_SLACK)
        return rlimits_argv(iso, rlimits, started_w), str(scratch), (started_w,), {}
    code_fd = os.memfd_create("main.py")
    fds.append(code_fd)
    os.write(code_fd, code.encode("utf-8"))
    os.lseek(code_fd, 0, os.SEEK_SET)
    # bwrap's own init is PID 1 of the run: one more process in the run's count
    argv = bwrap_argv(iso, limits.rlimits(extra_processes=1), limits.tmpfs_mb, code_fd, started_w)
    if os.geteuid() != 0:
        return argv, "/", (started_w, code_fd), {}
    # As root the kernel does not apply RLIMIT_NPROC in the run's user namespace (a fork bomb
    # is unbounded), so bwrap runs as `nobody`, exactly as it does for an unprivileged
    # trainer; exec'd through its fd, because its directory (e.g. under /root) may be closed
    # to that uid.
    bwrap_fd = os.open(iso.bwrap, os.O_RDONLY)
    fds.append(bwrap_fd)
    argv[0] = f"/proc/self/fd/{bwrap_fd}"
    user = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
    return argv, "/", (started_w, code_fd, bwrap_fd), user


def _spawn_and_wait(argv: list[str], cwd: str, pass_fds: tuple[int, ...], user: dict, io: Path,
                    timeout_s: float) -> tuple[int | None, bool, float]:
    """Start the run (stdin from io/stdin, output into io/stdout and io/stderr), wait up to
    `timeout_s`, then kill whatever is left of it. (exit code, timed out, wall seconds)."""
    with open(io / "stdin", "rb") as fin, open(io / "stdout", "wb") as fout, \
            open(io / "stderr", "wb") as ferr:
        start = time.monotonic()
        try:
            with SPAWN_LOCK:
                proc = subprocess.Popen(argv, cwd=cwd, env=CHILD_ENV, stdin=fin, stdout=fout,
                                        stderr=ferr, pass_fds=pass_fds, start_new_session=True,
                                        **user)
                LIVE_PIDS.add(proc.pid)
        except OSError as err:
            raise SandboxError(f"the sandbox could not start {argv[0]}: {err}") from err
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # bwrap: killing it kills the run's PID 1 (die-with-parent) and with it the whole
            # PID namespace; rlimits: the process group
            _kill_group(proc.pid)
            proc.wait()
            with SPAWN_LOCK:
                LIVE_PIDS.discard(proc.pid)
        return proc.returncode, timed_out, time.monotonic() - start


def _said_started(started_r: int) -> bool:
    os.set_blocking(started_r, False)
    try:
        return os.read(started_r, 1) == b"1"
    except BlockingIOError:  # a writer still open but nothing written: never started
        return False


def _run_once(iso: Isolation, code: str, stdin: str, limits: Limits) -> SandboxResult:
    """One run, no queueing (see run_python)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as io_dir:
        io = Path(io_dir)  # 0700, ours: stdin and captured output never visible to the run
        (io / "stdin").write_text(stdin, encoding="utf-8")
        started_r, started_w = os.pipe()
        fds = [started_r, started_w]
        try:
            argv, cwd, pass_fds, user = _launch(iso, code, limits, io, started_w, fds)
            exit_code, timed_out, wall_s = _spawn_and_wait(argv, cwd, pass_fds, user, io,
                                                           limits.timeout_s)
            os.close(started_w)
            fds.remove(started_w)
            started = _said_started(started_r)
        finally:
            for fd in fds:
                os.close(fd)
        stdout, cut_out = _read_capped(io / "stdout", limits.max_output_bytes)
        stderr, cut_err = _read_capped(io / "stderr", limits.max_output_bytes)
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
    python = pick_python()
    bwrap = find_bwrap()
    if bwrap is None:
        return Isolation("rlimits", python, None,
                         f"no bwrap binary (set {BWRAP_ENV}, put bwrap on PATH, or `make test` "
                         f"fetches it into {BWRAP_CACHE.parent.parent.parent})")
    iso = Isolation("bwrap", python, bwrap, mounts=host_mounts(python))
    try:
        probe = _run_once(iso, "print(6 * 7)", "", Limits(timeout_s=60))
    except SandboxError as err:
        return Isolation("rlimits", python, bwrap, f"bwrap cannot run here: {err}")
    if probe.stdout.strip() != "42":
        return Isolation("rlimits", python, bwrap,
                         f"bwrap probe printed {probe.stdout!r:.200}, stderr {probe.stderr!r:.300}")
    return iso


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


def queue_size(limits: Limits | None = None) -> int:
    """Runs at once in this process: the size of its one queue, `capacity(limits)` at the first
    run (or this call, if it comes first) and fixed from then on."""
    _Queue.slot(limits or Limits())
    return _Queue.size


def _check_backend(iso: Isolation, require_isolation: bool) -> None:
    """Raise SandboxError unless `iso` may run model code for this request in this process."""
    if iso.backend == "bwrap" or (not require_isolation and RLIMITS_ONLY_ALLOWED):
        return
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


def run_python(code: str, stdin: str = "", limits: Limits | None = None, *,
               require_isolation: bool = True) -> SandboxResult:
    """Run `code` on `stdin` under `limits` (see the module docstring), waiting for a free
    slot of the queue first. Without the bwrap backend it raises SandboxError, unless
    `require_isolation` is False AND this process is a sandbox service allowed to run with
    resource limits only."""
    limits = limits or Limits()
    iso = isolation()
    _check_backend(iso, require_isolation)
    if iso.backend != "bwrap":
        # Without namespaces, runs of one uid could read each other's files and /proc (a
        # program could copy a sibling sample's correct output): one run at a time, and as the
        # pod's PID 1 every leftover process of a run is killed after it and before the next.
        with _Queue.slot(limits), _RLIMITS_ONE_AT_A_TIME:
            _kill_leftovers()
            try:
                return _run_once(iso, code, stdin, limits)
            finally:  # and after it: a fork bomb's survivors would refill the uid's process count
                _kill_leftovers()
    with _Queue.slot(limits):
        return START_RETRY.call(lambda: _run_once(iso, code, stdin, limits))


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
    workers = min(len(jobs), queue_size(limits))
    if workers <= 1:
        return [run_python(c, s, limits, require_isolation=require_isolation) for c, s in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda job: run_python(job[0], job[1], limits,
                                                    require_isolation=require_isolation), jobs))
