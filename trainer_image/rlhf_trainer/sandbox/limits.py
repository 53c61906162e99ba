"""What one sandbox run may use (`Limits`), what it gives back (`SandboxResult`), and the error
for a sandbox that could not run at all (`SandboxError`).

Limits per run: wall time (the whole run is killed), CPU seconds, memory, processes (threads
count), file size and captured output, open files. Memory: RLIMIT_AS bounds each process and
RLIMIT_NPROC the number of processes of the run (counted per user namespace, so per run, with
bwrap), and the only writable space is the tmpfs of `tmpfs_mb`; a run therefore never holds more
than `Limits.memory_bound_mb` = max_processes * memory_mb + tmpfs_mb, and the queue admits only as
many runs as fit the memory the process may use (cgroup limit, see `cgroup.capacity`).

A SandboxError never stands for a 0 reward: what the program does (crash, timeout, memory
error, output flood) is a result; only a sandbox that cannot run (no bubblewrap, no
interpreter, the namespace setup failing) raises.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    """"bwrap" or "rlimits" (see `bwrap`'s docstring)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_truncated

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "SandboxResult":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})
