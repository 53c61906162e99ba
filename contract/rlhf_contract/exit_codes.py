"""The exit codes of our entry points (trainer, rollout server supervisor, sandbox,
`rlhfctl`), written once: the trainer exits with them, the operator and the local launcher
read them (permanent or retried), the JobSet failure policy lists the permanent ones, and
the reference in docs/ is generated from this table.

Permanent codes end a job at once (no restart can fix a bad config or a broken image);
every other non-zero code restarts the whole job from its newest checkpoint until
`runPolicy.maxRestarts` is spent."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    CONFIG_ERROR = 2
    """Invalid job config, data or command-line usage; also a trainer/server mismatch
    (NCCL or vLLM version) that only a new image fixes."""
    WEIGHT_SYNC = 75
    """EX_TEMPFAIL: a weight-sync round failed or hung; the job restarts with its servers."""
    NOT_EXECUTABLE = 126
    NOT_FOUND = 127
    INTERRUPTED = 130
    """Ctrl-C (SIGINT) in local mode."""
    TERMINATED = 143
    """128 + SIGTERM: stopped from outside (preemption, node drain, suspend, `kill`) after
    writing a checkpoint of the step it reached; the job resumes from it."""


@dataclass(frozen=True)
class Meaning:
    code: ExitCode
    text: str
    permanent: bool


TABLE: tuple[Meaning, ...] = (
    Meaning(ExitCode.OK, "done", False),
    Meaning(ExitCode.FAILED, "failed (a bug, a crash, an unanswered rollout server): the job restarts", False),
    Meaning(ExitCode.CONFIG_ERROR, "invalid job config, data or command-line usage, or an image mismatch", True),
    Meaning(ExitCode.WEIGHT_SYNC, "weight sync failed or hung: restarted with its rollout servers", False),
    Meaning(ExitCode.NOT_EXECUTABLE, "command not executable (broken image)", True),
    Meaning(ExitCode.NOT_FOUND, "command not found (broken image)", True),
    Meaning(ExitCode.INTERRUPTED, "interrupted (Ctrl-C, local mode)", False),
    Meaning(ExitCode.TERMINATED, "stopped by SIGTERM (preemption, drain, suspend) after saving a checkpoint", False),
)

PERMANENT: frozenset[int] = frozenset(int(m.code) for m in TABLE if m.permanent)
"""Codes no restart can fix: a job whose pod exits with one fails at once."""


def meaning(code: int | None) -> str | None:
    """What a non-zero exit `code` of ours means (None for codes we do not use)."""
    for m in TABLE:
        if code is not None and code != 0 and int(m.code) == code:
            return m.text
    return None


def is_permanent(code: int | None) -> bool:
    return code is not None and code in PERMANENT
