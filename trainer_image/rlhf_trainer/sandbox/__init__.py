"""Run untrusted Python (model-written code) where it can neither cheat, escape nor stall.

`run_python(code, stdin, limits)` runs one program on one input and returns a `SandboxResult`;
`run_many(jobs, limits)` runs many through ONE bounded queue per process. A sandbox that cannot
run at all (no bubblewrap, no interpreter, the namespace setup failing) raises `SandboxError`; it
never reports a 0 reward in disguise. What the program does (crash, timeout, memory error,
output flood) is a result.

  limits.py   `Limits` (per run: time, CPU, memory, processes, tmpfs, output), `SandboxResult`,
              `SandboxError`
  bwrap.py    the two backends and their command lines: bubblewrap (per-run user, PID, network,
              mount namespaces and root filesystem view) or resource limits only (for the
              sandbox service pod alone, which is then the barrier); why bubblewrap
  cgroup.py   `capacity()`: runs at once, from the cgroup CPU quota, affinity and memory limit
  run.py      `isolation()` (which backend this host allows, probed once), `run_python`,
              `run_many`, the queue, killing leftovers of runs when PID 1
  service.py  the sandbox service: a separate program (`python -m rlhf_trainer.sandbox.service`)
              that runs these in its own pod, out of the trainer's reach
  client.py   `SandboxClient`: the trainer's side of the service, `run_many` over HTTP

The trainer uses it for the code reward (`rewards.code`): in its own process tree with
bubblewrap in local mode, through `SandboxClient` on a cluster. The package needs the standard
library alone (the client imports httpx when it sends), so the service runs on any Python 3.11+
with this package on its path.
"""

from rlhf_trainer.sandbox.bwrap import BWRAP_ENV, SANDBOX_UID, Isolation, find_bwrap
from rlhf_trainer.sandbox.cgroup import (CONCURRENCY_ENV, available_cpus, capacity,
                                         cgroup_memory_limit_mb)
from rlhf_trainer.sandbox.client import SandboxClient
from rlhf_trainer.sandbox.limits import Limits, SandboxError, SandboxResult
from rlhf_trainer.sandbox.run import (isolation, queue_size, run_many, run_python,
                                      set_rlimits_only_allowed)

__all__ = ["BWRAP_ENV", "CONCURRENCY_ENV", "SANDBOX_UID", "Isolation", "Limits", "SandboxClient",
           "SandboxError", "SandboxResult", "available_cpus", "capacity", "cgroup_memory_limit_mb",
           "find_bwrap", "isolation", "queue_size", "run_many", "run_python",
           "set_rlimits_only_allowed"]
