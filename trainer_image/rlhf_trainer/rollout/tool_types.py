"""What tools.py (Python tools) and mcp_tools.py (MCP servers) share: a call's outcome and the
error of a tool that cannot be loaded or listed."""

from __future__ import annotations

from dataclasses import dataclass

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
