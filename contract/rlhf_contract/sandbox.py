"""The code sandbox service's part of the pod contract: its name, port, URL and command.

With `reward.type: code` on a cluster, the operator runs the trainer's image as a sandbox
service (`<job>-sandbox`: a StatefulSet, a Service and a NetworkPolicy) that executes
model-written programs out of the trainer's pod; the trainer reaches it at
`sandbox_url(job, namespace)` (or at `reward.sandbox.url` when set, or `$RLHF_SANDBOX_URL`).
Local mode runs programs in the trainer's own process tree with bubblewrap, the same code the
service runs (`rlhf_trainer.sandbox`).
"""

from __future__ import annotations

ENV_SANDBOX_URL = "RLHF_SANDBOX_URL"
SANDBOX_PORT = 8080
LABEL_SANDBOX_OF = "rlhf.dev/sandbox-of"
"""Pod label of a job's sandbox pods (deliberately NOT `rlhf.dev/job`, which the job's
NetworkPolicy lets reach the trainer and rollout ports)."""


def sandbox_name(job: str) -> str:
    """The sandbox Deployment, Service and NetworkPolicy of a job."""
    return f"{job}-sandbox"


def sandbox_url(job: str, namespace: str | None) -> str:
    return f"http://{sandbox_name(job)}.{namespace or 'default'}.svc:{SANDBOX_PORT}"


def sandbox_command(*, host: str = "0.0.0.0", port: int = SANDBOX_PORT, python: str = "python",
                    require_isolation: bool = True) -> list[str]:
    """The sandbox service's command line (it must run as the container's PID 1: exec form)."""
    command = [python, "-m", "rlhf_trainer.sandbox.service", "--host", host, "--port", str(port)]
    if not require_isolation:
        command.append("--allow-rlimits-only")
    return command
