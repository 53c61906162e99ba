"""The two ways a run is confined, and the command line of each: bubblewrap, or resource limits
only. Which one this host allows is probed once by `run.isolation()`.

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
           `--allow-rlimits-only` runs it (`run.set_rlimits_only_allowed`), and only for requests
           with `require_isolation=False`. Runs go one at a time (same-uid runs could otherwise read
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

Inside either backend, `BOOTSTRAP` lowers the limits, reports that it started, and runs main.py
as __main__.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_trainer.sandbox.limits import SandboxError

BWRAP_ENV = "RLHF_BWRAP"
"""Path of the bwrap binary; otherwise PATH, then the cache that `make test` fills."""
BWRAP_CACHE = Path.home() / ".cache" / "rlhf-operator" / "bubblewrap" / "usr" / "bin" / "bwrap"
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


def pick_python() -> str:
    """The interpreter programs run with: the system Python, else this one."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SandboxError("no Python interpreter for the sandbox: tried /usr/bin/python3, "
                       f"/usr/local/bin/python3, {sys.executable}")


def host_mounts(python: str) -> tuple[str, ...]:
    """Read-only host directories a run needs: /usr, plus the interpreter's prefix if elsewhere."""
    mounts = ["/usr"]
    prefix = Path(os.path.realpath(python)).parent.parent
    if not str(prefix).startswith("/usr/") and str(prefix) != "/usr":
        mounts.append(str(prefix))
    return tuple(mounts)


def bwrap_argv(iso: Isolation, rlimits: dict[str, int], tmpfs_mb: int, code_fd: int,
               started_fd: int) -> list[str]:
    """bwrap's command line for one run: main.py from `code_fd`, "started" on `started_fd`."""
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


def rlimits_argv(iso: Isolation, rlimits: dict[str, int], started_fd: int) -> list[str]:
    """The command line of a run with resource limits only (main.py in its working directory)."""
    return [iso.python, "-I", "-S", "-c", BOOTSTRAP, json.dumps(rlimits), str(started_fd)]
