"""Tools for tool-calling rollouts (`rollout.tools`): their OpenAI schemas, the parser of the
model's calls, and `ToolRunner`, which executes calls in worker processes with limits, or
on MCP servers (mcp_tools.py, the same limits).

- `load_tools(spec)`: imports each function in the trainer (as a `python` reward is loaded,
  rewards/forms.py) to check it exists and to make its schema when none is given
  (transformers' `get_json_schema`, from the signature and a Google-style docstring).
- `parse_tool_calls(text)`: the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` (any number, anywhere after the content); a call that is not such JSON
  is a `ToolCall` with `error` set (the model's mistake, told to the model).
- `ToolRunner`: `await runner.call(name, arguments)` runs the call in one of up to
  `maxProcesses` long-lived worker processes (tool_worker.py; each imports the tool files
  once). A call past `timeoutSeconds` has its worker's process group killed; a worker that
  dies is replaced on the next call. The outcome is a `ToolOutcome`: content, or a failure
  `kind`: `arguments` (unknown tool, arguments that do not fit: the model's mistake) or an
  episode-ending `timeout`, `raised`, `output` (past `maxOutputBytes`) or `crashed`.

Why not the code sandbox (sandbox/): it runs one model-written program per fresh bubblewrap
process, for code nobody trusts. Tools are the user's code, trusted as reward functions are;
what must not happen is that one call stalls or floods the step, which a killable child
process with a timeout and an output cap prevents at a fraction of a process start per call.
Not limited here: a tool's memory and CPU beyond its wall-clock limit, and what it does to
the machine (files, network), as for a python reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_contract.api.tools import ToolsSpec

from .tool_types import ENDING_KINDS, ToolConfigError, ToolOutcome  # noqa: F401  (the module's API)

WORKER = Path(__file__).with_name("tool_worker.py")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def schema_name(schema: dict) -> str:
    return schema.get("function", schema)["name"]


def load_tools(spec: ToolsSpec) -> list[dict]:
    """The OpenAI schema of each tool of `spec` (`{type: function, function: {...}}`): the
    functions', then each MCP server's (`mcp_tools.list_servers`)."""
    return load_tool_set(spec)[0]


def load_tool_set(spec: ToolsSpec) -> tuple[list[dict], dict[str, int]]:
    """(the schemas, as `load_tools`; which MCP server serves each MCP tool: name -> index in
    `mcpServers`), checking that each function exists and each server lists its tools;
    ToolConfigError naming `rollout.tools.functions[i]` or `rollout.tools.mcpServers[i]`."""
    from .mcp_tools import list_servers

    schemas = _function_schemas(spec)
    taken = {schema_name(s): f"rollout.tools.functions[{i}]" for i, s in enumerate(schemas)}
    servers = {}
    for index, listed in enumerate(list_servers(spec, taken)):
        schemas += listed
        servers.update({schema_name(s): index for s in listed})
    return schemas, servers


def _function_schemas(spec: ToolsSpec) -> list[dict]:
    from ..rewards.forms import RewardConfigError, load_function

    schemas = []
    for i, tool in enumerate(spec.functions):
        where = f"rollout.tools.functions[{i}]"
        try:
            fn, _ = load_function(tool.file, tool.function)
        except RewardConfigError as err:
            raise ToolConfigError(f"{where}: {err}".replace("reward file", "tool file")) from None
        if tool.schema_ is not None:
            schema = tool.schema_ if "function" in tool.schema_ else {"type": "function", "function": tool.schema_}
        else:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)
            except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
                raise ToolConfigError(f"{where}.schema: none given, and {tool.function} in {tool.file} cannot be "
                                      f"described from its signature and docstring ({err}); give its OpenAI "
                                      "schema, or type hints and a Google-style docstring with Args:") from None
        schemas.append(schema)
    return schemas


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    error: str | None = None
    """Why the call could not be read (then `name` and `arguments` are empty)."""


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the content before the first call, stripped; the calls in order). An opened
    `<tool_call>` never closed counts as an unreadable call."""
    calls = []
    for body in _CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", {}, f"the tool call is not JSON ({err})"))
            continue
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):  # some templates write arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'a tool call must be {"name": <tool>, "arguments": {...}}'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    tail = _CALL.sub("", text)
    if "<tool_call>" in tail:
        calls.append(ToolCall("", {}, "a <tool_call> was not closed with </tool_call>"))
    start = text.find("<tool_call>")
    return (text if start < 0 else text[:start]).strip(), calls


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ToolRunner:
    """Runs tool calls in worker processes (module docstring). Used from one event loop at a
    time: a call from another loop first retires the workers of the previous one."""

    def __init__(self, spec: ToolsSpec, schemas: list[dict], servers: dict[str, int] | None = None):
        self.spec = spec
        self.setup = json.dumps({"max_output_bytes": spec.max_output_bytes, "tools": [
            {"name": schema_name(s), "file": str(Path(t.file).resolve()), "function": t.function}
            for t, s in zip(spec.functions, schemas)]}) + "\n"
        self.names = sorted(schema_name(s) for s in schemas)
        self.servers = dict(servers or {})
        """MCP tool name -> its server's index in `spec.mcp_servers` (mcp_tools.py)."""
        self._mcp: list = []
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        # a reply is at most max_output_bytes of content, JSON-escaped (up to 6 bytes a character)
        self._line_limit = 6 * spec.max_output_bytes + 65536

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the workers belong to (None: no worker yet)."""
        return self._loop

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            from .mcp_tools import McpServer

            self.close()
            self._loop, self._slots = loop, asyncio.Semaphore(self.spec.max_processes)
            self._mcp = [McpServer(s, f"rollout.tools.mcpServers[{i}]", self.spec)
                         for i, s in enumerate(self.spec.mcp_servers)]

    async def _start(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True, limit=self._line_limit)
        worker = _Worker(proc)
        self._all.add(worker)
        proc.stdin.write(self.setup.encode())
        try:
            ready = await asyncio.wait_for(proc.stdout.readline(), timeout=max(60.0, self.spec.timeout_seconds))
        except asyncio.TimeoutError:
            ready = b""
        if not ready:
            await self._discard(worker)
            raise ToolConfigError("rollout.tools: the tool worker process could not import the tool files")
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)

    async def _discard(self, worker: _Worker) -> None:
        """Kill `worker`, wait for it to end and close its pipes."""
        self._retire(worker)
        await worker.proc.wait()
        worker.proc._transport.close()  # noqa: SLF001  (asyncio closes it only when garbage-collected)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        self._bind_loop()
        if name in self.servers:
            return await self._mcp[self.servers[name]].call(name, arguments)
        if name not in self.names:
            return ToolOutcome(kind="arguments", error=f"no tool named {name!r}; the tools are {', '.join(self.names)}")
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._start()
            outcome = await self._ask(worker, name, arguments)
            if worker in self._all:
                self._idle.append(worker)
            return outcome

    async def _ask(self, worker: _Worker, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        proc = worker.proc
        try:
            proc.stdin.write((json.dumps({"name": name, "arguments": arguments}) + "\n").encode())
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=self.spec.timeout_seconds)
        except asyncio.TimeoutError:
            await self._discard(worker)
            return ToolOutcome(kind="timeout", error=f"{name} ran past {self.spec.timeout_seconds:g} s "
                               "(rollout.tools.timeoutSeconds)")
        except (ValueError, asyncio.LimitOverrunError):  # a reply line past the limit
            await self._discard(worker)
            return ToolOutcome(kind="output", error=f"{name}'s reply is larger than the output cap")
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            await self._discard(worker)
            code = proc.returncode
            return ToolOutcome(kind="crashed", error=f"{name}'s worker process ended (exit status {code})")
        reply = json.loads(line)
        if reply["ok"]:
            return ToolOutcome(content=reply["content"])
        return ToolOutcome(kind=reply["kind"], error=reply["error"])

    def close(self) -> None:
        """Kill every worker (the next call starts new ones); from the workers' own event loop,
        or once it stopped (`aclose` also reaps them)."""
        for worker in list(self._all):
            self._retire(worker)
        self._idle.clear()
        for server in self._mcp:
            server.close()
        self._mcp, self._loop = [], None

    async def aclose(self) -> None:
        """`close`, on the workers' loop, waiting for each process to end and its pipes to close."""
        for worker in list(self._all):
            await self._discard(worker)
        await asyncio.gather(*(server.aclose() for server in self._mcp))
        self.close()
