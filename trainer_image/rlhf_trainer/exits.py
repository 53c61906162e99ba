"""How a trainer process's exit code and first error reach the pod: torchrun turns every
worker failure into 1, so a worker that must end the job with a code of ours
(`rlhf_contract.exit_codes`: 2, a config error only it could see; 75, a failed weight
sync) writes it into the launcher's marker file, and the launcher (launch.py) exits with
it. The first error also goes to the container's termination message, which Kubernetes
shows as the pod's (and so the job's) Failed reason.

It decides no code itself: the numbers and what they mean live in the contract."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.redact import redact_text

TERMINATION_LOG = "/dev/termination-log"
ENV_CONFIG_ERROR_FILE = "RLHF_CONFIG_ERROR_FILE"
"""Set by the launcher: the marker file a worker writes its exit code into."""


def mark_exit_code(code: int) -> None:
    """Ask the launcher to exit with `code`. A config error wins over any other code."""
    path = os.environ.get(ENV_CONFIG_ERROR_FILE)
    if path:
        try:
            if code == ExitCode.CONFIG_ERROR or not Path(path).exists():
                Path(path).write_text(str(int(code)))
        except OSError:
            pass


def mark_config_error() -> None:
    mark_exit_code(ExitCode.CONFIG_ERROR)


def marked_exit_code(path: Path) -> int | None:
    """The code a worker asked for (see `mark_exit_code`), or None."""
    try:
        return int(path.read_text().strip() or ExitCode.CONFIG_ERROR)
    except (OSError, ValueError):
        return None


def write_termination_message(message: str) -> None:
    """Put `message` in the container's termination message (which the operator copies into the
    job's status and events), URL credentials cut; only the first is kept."""
    path = os.environ.get("RLHF_TERMINATION_LOG", TERMINATION_LOG)
    try:
        if os.path.exists(path) and os.path.getsize(path) == 0:
            with open(path, "a") as f:
                f.write(redact_text(message)[:4000])
    except OSError:
        pass


class ConfigErrorExit(SystemExit):
    """A failure only the spec can fix, found while running: exit code 2 (the job fails at
    once, no restart); `str()` says why and what to set."""

    def __init__(self, message: str):
        super().__init__(ExitCode.CONFIG_ERROR)
        self.message = message

    def __str__(self) -> str:
        return self.message

    @classmethod
    def reported(cls, message: str):
        """The error, its message logged and printed first (the process then exits with code 2,
        which prints nothing: this line is what reaches the pod's log)."""
        logging.getLogger(cls.__module__).error("%s", message)
        print(f"ERROR: {message}", file=sys.stderr, flush=True)
        return cls(message)
