"""What tools.py (Python tools), mcp_tools.py (MCP servers) and agent_episodes.py share: a
call's outcome, the error of a tool that cannot be loaded or listed, and how a configured
command is started."""

from __future__ import annotations

import sys
from dataclasses import dataclass


def program_command(command: list[str]) -> list[str]:
    """A configured command (an agent's, an MCP stdio server's) as started: `python` /
    `python3` first means the trainer's interpreter."""
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else list(command)

ENDING_KINDS = ("timeout", "raised", "output", "crashed")
"""Failures that end the episode (`tool_<kind>` is its end reason)."""


class ToolConfigError(ValueError):
    """A tool that cannot be loaded or described: the job's config, not a restart, must change."""


@dataclass
class ToolOutcome:
    content: str | None = None
    kind: str | None = None
    """None: success; else `arguments`, `reported` (an MCP tool's `isError` result; both told
    to the model), or one of ENDING_KINDS."""
    error: str = ""

    @property
    def ends_episode(self) -> bool:
        return self.kind in ENDING_KINDS
