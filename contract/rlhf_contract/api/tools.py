"""Tools the policy may call during a rollout (`rollout.tools`): OpenAI function schemas
implemented as Python functions or served by MCP servers, their limits, and the episode's
budgets."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, JsonValue, WithJsonSchema, field_validator, model_validator

from .common import MAX_SECONDS, SpecModel
from .uris import ENV_SECRET, EndpointUrl

ToolSchema = Annotated[dict[str, JsonValue], WithJsonSchema(
    {"type": "object", "x-kubernetes-preserve-unknown-fields": True})]
"""An OpenAI function schema, kept as written (the CRD keeps its unknown fields)."""


class ToolFunctionSpec(SpecModel):
    """One tool: a Python function from a file (as a `python` reward is given), and the
    OpenAI function schema the chat template shows the model."""

    file: str = Field(min_length=1)
    """Path of the Python file that defines the function."""
    function: str = Field(min_length=1, max_length=512, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The function's name in `file`; the model's call passes its `arguments` as keywords, and
    what it returns (text, or any JSON value) is the tool message; a function that returns
    None answers what it printed."""
    schema_: ToolSchema | None = Field(default=None, alias="schema")
    """The OpenAI tool schema, `{type: function, function: {name, description, parameters}}`
    (or its `function` part alone); null: made from the function's signature and Google-style
    docstring (transformers' `get_json_schema`). The model calls the tool by its schema's name."""

    @field_validator("schema_")
    @classmethod
    def _openai_schema(cls, value: dict | None) -> dict | None:
        if value is None:
            return None
        function = value.get("function", value)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError("must be an OpenAI function schema with a name: {type: function, function: "
                             "{name, description, parameters}}")
        return value


class McpServerSpec(SpecModel):
    """An MCP (Model Context Protocol) server whose tools the model may call: a program the
    trainer starts and talks to over stdio (`command`), or a Streamable HTTP endpoint (`url`)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """The server's name, for messages (its tools keep their own names)."""
    command: list[str] | None = Field(default=None, min_length=1, max_length=256)
    """A stdio server: its command, started by the trainer as a child process in the job's
    working directory (`python` first: the trainer's own interpreter), e.g. `[python,
    calculator_mcp.py]`; restarted when a call times out or it dies."""
    env: dict[str, str] = Field(default_factory=dict, max_length=256)
    """A stdio server's environment, over the trainer's; `${NAME}` in a value is the trainer's
    variable NAME (give a secret to the trainer with pod.env valueFrom a Secret)."""
    url: EndpointUrl(f"headers with ${{NAME}}, NAME set from {ENV_SECRET}", pattern=r"^https?://") | None = None
    """A Streamable HTTP server: its endpoint, e.g. `http://tools.default.svc:8000/mcp`."""
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)
    """HTTP headers sent with each request to `url`; `${NAME}` in a value is the trainer's
    environment variable NAME (e.g. `Authorization: Bearer ${TOOLS_TOKEN}`, the variable set
    from a Secret with pod.env), so no secret is written into the job."""
    tools: list[str] | None = Field(default=None, min_length=1, max_length=256)
    """Expose only these of the server's tools (null: all it lists); a name it does not list
    is an error at start."""

    @model_validator(mode="after")
    def _one_transport(self) -> "McpServerSpec":
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server the trainer starts) or url (a Streamable HTTP "
                             "endpoint), not both or neither")
        if self.command is not None and not self.command[0]:
            raise ValueError("command: the first word (the program) must not be empty, e.g. [python, server.py]")
        if self.url is not None and self.env:
            raise ValueError("env is for a stdio server (command); an HTTP server takes headers")
        if self.command is not None and self.headers:
            raise ValueError("headers are for an HTTP server (url); a stdio server takes env")
        return self


class ToolsSpec(SpecModel):
    """Multi-turn rollouts with tools: the model's `<tool_call>` turns (Hermes / Qwen format) are
    executed and answered with tool messages rendered by the tokenizer's chat template, until it
    answers without a call, `maxTurns`, or `rollout.maxTokens` (the whole episode's tokens);
    `spec.reward` scores its final answer."""

    functions: list[ToolFunctionSpec] = Field(default_factory=list, max_length=64)
    """Tools that are Python functions (each name unique among all the tools)."""
    mcp_servers: list[McpServerSpec] = Field(default_factory=list, max_length=16)
    """MCP servers whose tools the model may call, beside `functions` (docs/methods.md,
    "Tools"); their tools are listed at start, each name unique among all the tools."""
    max_turns: int = Field(default=4, ge=1, le=64)
    """Model turns per episode; an episode still calling tools at the last one is truncated."""
    timeout_seconds: float = Field(default=10.0, gt=0, le=MAX_SECONDS)
    """Wall-clock limit of one tool call; past it the call's process is killed and the episode
    ends (reason `tool_timeout`)."""
    max_output_bytes: int = Field(default=65536, ge=16, le=2**24)
    """Largest tool result (and most it may print, UTF-8 bytes); past it the episode ends
    (reason `tool_output`)."""
    max_concurrent_episodes: int = Field(default=64, ge=1, le=4096)
    """Episodes run at once (their generation requests and tool calls overlap)."""
    max_processes: int = Field(default=4, ge=1, le=256)
    """Tool worker processes (tool calls running at once); each lives across calls and is
    replaced when a call kills it."""

    @model_validator(mode="after")
    def _unique_names(self) -> "ToolsSpec":
        if not self.functions and not self.mcp_servers:
            raise ValueError("rollout.tools: give functions (Python functions) or mcpServers (MCP servers), or both")
        servers = [s.name for s in self.mcp_servers]
        if len(set(servers)) < len(servers):
            raise ValueError(f"rollout.tools.mcpServers: names {sorted({n for n in servers if servers.count(n) > 1})} "
                             "appear more than once; give each server its own name")
        names = [(f.schema_.get("function", f.schema_)["name"] if f.schema_ else f.function) for f in self.functions]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"rollout.tools.functions: tool names {repeated} appear more than once; "
                             "give each tool its own name")
        return self


class AgentSpec(SpecModel):
    """An agent program of one's own (any language, an OpenAI client) runs each episode against an
    OpenAI-compatible chat completions endpoint the trainer serves per episode; the trainer trains
    on the tokens it recorded there (never on what the agent sends back), and `spec.reward` scores
    the recorded conversation (docs/methods.md, "Agents")."""

    command: list[str] = Field(min_length=1, max_length=256)
    """The agent's command, started once per episode in the job's working directory (`python`
    first: the trainer's own interpreter). Its environment has `OPENAI_BASE_URL` and
    `OPENAI_API_KEY` (the episode's endpoint and key) and `RLHF_EPISODE_ID`; its stdin is the
    episode as one JSON object, `{"id": ..., "messages": [...]}` (the prompt as chat messages)."""
    max_concurrent_episodes: int = Field(default=16, ge=1, le=4096)
    """Agent processes (episodes) running at once."""
    timeout_seconds: float = Field(default=300.0, gt=0, le=MAX_SECONDS)
    """Wall-clock limit of one episode; past it the agent's process group is killed and the episode
    ends (reason `agent_timeout`) with what was recorded so far."""
    max_turns: int = Field(default=8, ge=1, le=256)
    """Chat completion calls per episode; a call past them is refused (HTTP 400) and the episode is
    truncated (reason `turn_budget`)."""

    @field_validator("command")
    @classmethod
    def _no_empty_words(cls, value: list[str]) -> list[str]:
        if not value[0]:
            raise ValueError("the first word (the program) must not be empty, e.g. [python, agent.py]")
        return value
