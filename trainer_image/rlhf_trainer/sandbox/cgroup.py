"""How many runs this process may have at once: `capacity()`, from the CPUs and memory its
cgroup gives it.

Concurrency: ONE queue per process (`run.queue_size()`, fixed at first use) admits `capacity()`
runs at once: the CPUs this process may use (cgroup CPU quota and CPU affinity, never the host's
core count), and no more than the cgroup memory limit holds at `Limits.memory_bound_mb` a run.
`$RLHF_SANDBOX_CONCURRENCY` overrides it. Both cgroup v2 and v1 are read; a limit that cannot be
read counts as none.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlhf_trainer.sandbox.limits import Limits

CONCURRENCY_ENV = "RLHF_SANDBOX_CONCURRENCY"
"""Overrides `capacity()` (runs at once in this process)."""


def available_cpus() -> float:
    """CPUs this process may use: its affinity, cut by the cgroup CPU quota (v2 or v1)."""
    cpus = float(len(os.sched_getaffinity(0)))
    quota = cgroup_cpu_quota()
    return min(cpus, quota) if quota else cpus


def cgroup_file(v2_name: str, v1_controller: str, v1_name: str) -> str | None:
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


def cgroup_cpu_quota() -> float | None:
    """The cgroup's CPU quota in CPUs (v2 cpu.max or v1 cfs quota / period), or None."""
    v2 = cgroup_file("cpu.max", "cpu", "cpu.cfs_quota_us")
    if v2 and " " in v2:
        quota, period = v2.split()
        return None if quota == "max" else int(quota) / int(period)
    if v2 and int(v2) > 0:
        period = cgroup_file("", "cpu", "cpu.cfs_period_us")
        return int(v2) / int(period or 100000)
    return None


def cgroup_memory_limit_mb() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max or v1), or None."""
    text = cgroup_file("memory.max", "memory", "memory.limit_in_bytes")
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
