"""MCP servers as tools (`rollout.tools.mcpServers`), with the MCP Python SDK's client.

- `list_servers(spec)`: at start, connects to each server (a stdio server: its command
  started as the trainer's child in the working directory; a Streamable HTTP endpoint),
  `initialize`s, lists its tools (every page) and closes again; each tool becomes the
  OpenAI schema `{type: function, function: {name, description, parameters: inputSchema}}`.
  A server that cannot start or list, a `tools` name it does not list, or a tool name
  another tool has is a ToolConfigError naming `rollout.tools.mcpServers[i]`.
- `McpServer`: one server for the runner's event loop. Its session lives in ONE long-lived
  task (the SDK's context managers must be entered and left by the same task), which takes
  calls from a queue and runs each as a child task on the session, so calls to one server
  overlap. A call past `timeoutSeconds` is answered `timeout` at once; a stdio server is
  then stopped (the SDK's shutdown: stdin closed, then its process group terminated, then
  killed) once the other calls in flight on it ended, and started afresh for the next call.
  A connection that closes mid-call (the server died) is `crashed`, and the next call
  reconnects. An HTTP server is not restarted after a timeout (the call is cancelled).
- The result: the text blocks joined by newlines (other blocks named, not shown); over
  `maxOutputBytes` it is `output` (the reply was read whole first). `isError: true` is how
  MCP tells the model its call failed (arguments the server refused, a tool that raised):
  its text is told to the model as an `error: ...` tool message (kind `reported`) and the
  episode goes on, as for arguments that do not fit a Python tool. A JSON-RPC error reply
  is `arguments` for invalid params or an unknown method, else `raised`.

Not limited here, as for Python tools: a stdio server's memory and what it does to the
machine (it is the user's program, not sandboxed), and its environment (the trainer's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import string
import subprocess
import sys
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, AsyncIterator

from rlhf_contract.api.tools import McpServerSpec, ToolsSpec

from .tool_types import ToolConfigError, ToolOutcome, program_command

CONNECT_TIMEOUT_S = 60.0
"""Most a server may take to start, initialize and list its tools (or the call timeout, if longer)."""
_CLOSE = object()


def _expand(values: dict[str, str], where: str) -> dict[str, str]:
    """`${NAME}` in each value replaced by the trainer's environment variable NAME."""
    out = {}
    for key, value in values.items():
        try:
            out[key] = string.Template(value).substitute(os.environ)
        except KeyError as err:
            raise ToolConfigError(f"{where}.{key}: ${{{err.args[0]}}} is not set in the trainer's environment; "
                                  "set it (pod.env, e.g. from a Secret) or write the value") from None
        except ValueError as err:
            raise ToolConfigError(f"{where}.{key}: {err}; write $$ for a literal $") from None
    return out


@asynccontextmanager
async def connect(spec: McpServerSpec, where: str, limits: ToolsSpec) -> AsyncIterator[Any]:
    """An initialized `ClientSession` with the server (ToolConfigError: bad env / headers)."""
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    async with AsyncExitStack() as stack:
        if spec.command is not None:
            command = program_command(spec.command)
            env = {**os.environ, **_expand(spec.env, f"{where}.env")}
            params = StdioServerParameters(command=command[0], args=command[1:], env=env, cwd=os.getcwd())
            read, write = await stack.enter_async_context(stdio_client(params, errlog=_stderr()))
        else:
            from mcp.client.streamable_http import streamable_http_client
            from mcp.shared._httpx_utils import create_mcp_http_client

            http = await stack.enter_async_context(create_mcp_http_client(
                headers=_expand(spec.headers, f"{where}.headers")))
            read, write = await stack.enter_async_context(streamable_http_client(spec.url, http_client=http))
        session = await stack.enter_async_context(ClientSession(read, write))
        with anyio.fail_after(max(CONNECT_TIMEOUT_S, limits.timeout_seconds)):
            await session.initialize()
        yield session


def _stderr() -> Any:
    """Where a stdio server's stderr goes: the trainer's (its log), if it is a file."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL
    return sys.stderr


async def list_tools(session: Any) -> list[Any]:
    from mcp.types import PaginatedRequestParams

    tools, cursor = [], None
    while True:
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


def openai_schema(tool: Any) -> dict:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema}}


def _describe(err: BaseException) -> str:
    """An exception's message; for an exception group, its first leaf's."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    return f"{type(err).__name__}: {err}"


async def _list_server(spec: McpServerSpec, where: str, limits: ToolsSpec) -> list[dict]:
    import anyio

    what = f"cannot start {spec.command}" if spec.command is not None else f"cannot reach {spec.url}"
    try:
        with anyio.fail_after(2 * max(CONNECT_TIMEOUT_S, limits.timeout_seconds)):
            async with connect(spec, where, limits) as session:
                tools = await list_tools(session)
    except ToolConfigError:
        raise
    except Exception as err:  # OSError (no such program), MCPError (it exited), HTTP errors, the timeout
        raise ToolConfigError(f"{where}: {what} and list its tools ({_describe(err)}); fix the server or "
                              "remove it") from None
    listed = {t.name: t for t in tools}
    if spec.tools is not None:
        missing = [n for n in spec.tools if n not in listed]
        if missing:
            raise ToolConfigError(f"{where}.tools: the server lists no tool {missing[0]!r} (it lists "
                                  f"{', '.join(sorted(listed)) or 'none'}); fix the name")
        return [openai_schema(listed[n]) for n in spec.tools]
    return [openai_schema(t) for t in tools]


def list_servers(spec: ToolsSpec, taken: dict[str, str]) -> list[list[dict]]:
    """Each server's tools as OpenAI schemas (module docstring); `taken`: the names already
    used (name -> where), to which the servers' tools are added."""
    if not spec.mcp_servers:
        return []
    async def main() -> list[list[dict]]:
        results = await asyncio.gather(*(_list_server(s, f"rollout.tools.mcpServers[{i}]", spec)
                                         for i, s in enumerate(spec.mcp_servers)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        listed = asyncio.run(main())
    else:  # called from a running loop: list on a loop of its own
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            listed = pool.submit(asyncio.run, main()).result()
    for i, schemas in enumerate(listed):
        where = f"rollout.tools.mcpServers[{i}]"
        for schema in schemas:
            name = schema["function"]["name"]
            if name in taken:
                raise ToolConfigError(f"{where}: its tool {name!r} has the name of {taken[name]}'s; tool names must "
                                      f"be unique: expose only some of its tools with {where}.tools, or rename one")
            taken[name] = f"{where} ({spec.mcp_servers[i].name})"
    return listed


class McpServer:
    """One MCP server for the runner's event loop (module docstring): `await call(...)`,
    `await aclose()`."""

    def __init__(self, spec: McpServerSpec, where: str, limits: ToolsSpec):
        self.spec, self.where, self.limits = spec, where, limits
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._broken = False
        self._waiting: Any = None
        """The cancel scope of the owner's wait for the next call (a failing call cancels it)."""
        self.starts = 0
        """Sessions opened (a restart opens another)."""

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():  # the first call, or the owner task died
            self._task = loop.create_task(self._serve(), name=f"mcp {self.spec.name}")
        task, reply = self._task, loop.create_future()
        self._queue.put_nowait((name, arguments, reply))
        await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        error = None if task.cancelled() else task.exception()  # a bug: the owner ended without answering
        return ToolOutcome(kind="crashed", error=f"{name}: the session with the MCP server {self.spec.name} ended "
                           f"({_describe(error) if error else 'cancelled'})")

    def _break(self) -> None:
        """Stop using this session: no call is sent to it, and it ends once the calls in flight did."""
        self._broken = True
        if self._waiting is not None:
            self._waiting.cancel()

    async def _serve(self) -> None:
        import anyio

        held = None
        while True:
            if held is None:
                held = await self._queue.get()
            if held is _CLOSE:
                return
            started = False
            try:
                async with connect(self.spec, self.where, self.limits) as session:
                    started, self._broken = True, False
                    self.starts += 1
                    async with anyio.create_task_group() as calls:
                        while not self._broken:
                            if held is None:
                                with anyio.CancelScope() as self._waiting:
                                    held = await self._queue.get()
                                self._waiting = None
                            if held is None or self._broken:
                                break
                            if held is _CLOSE:
                                calls.cancel_scope.cancel()
                                break
                            calls.start_soon(self._call, session, *held)
                            held = None
            except Exception as err:  # noqa: BLE001  (each call in flight was answered by its task)
                if not started and held is not None and held is not _CLOSE:  # it could not be (re)started
                    _answer(held[2], ToolOutcome(kind="crashed", error=f"{held[0]}: the MCP server {self.spec.name} "
                                                 f"could not be started again ({_describe(err)})"))
                    held = None

    async def _call(self, session: Any, name: str, arguments: dict[str, Any], reply: asyncio.Future) -> None:
        import anyio
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, INVALID_PARAMS, METHOD_NOT_FOUND

        limit = self.limits.timeout_seconds
        try:
            with anyio.fail_after(limit):
                result = await session.call_tool(name, arguments)
        except TimeoutError:
            outcome = ToolOutcome(kind="timeout", error=f"{name} ran past {limit:g} s (rollout.tools.timeoutSeconds)")
            if self.spec.command is not None:
                self._break()
        except anyio.get_cancelled_exc_class():
            _answer(reply, ToolOutcome(kind="crashed", error=f"{name}: the call was cancelled (the MCP server "
                                       f"{self.spec.name} failed, or the tool runner closed)"))
            raise
        except MCPError as err:
            if err.code == CONNECTION_CLOSED:
                outcome = ToolOutcome(kind="crashed", error=f"{name}: the MCP server {self.spec.name} closed the "
                                      "connection (it ended?)")
                self._break()
            else:
                kind = "arguments" if err.code in (INVALID_PARAMS, METHOD_NOT_FOUND) else "raised"
                outcome = ToolOutcome(kind=kind, error=f"{name}: {err.message}"[:2000])
        except Exception as err:  # noqa: BLE001  (the transport failed)
            outcome = ToolOutcome(kind="crashed", error=f"{name}: the MCP server {self.spec.name} failed "
                                  f"({_describe(err)})"[:2000])
            self._break()
        else:
            outcome = result_outcome(name, result, self.limits.max_output_bytes)
        _answer(reply, outcome)

    def close(self) -> None:
        """Stop the owner task without waiting (its loop finishes the server's shutdown, if it runs)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                task.get_loop().call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop is closed: the stdio server ends when its stdin does
                pass

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._queue.put_nowait(_CLOSE)
        if self._waiting is not None:
            self._waiting.cancel()
        try:
            await asyncio.wait_for(task, timeout=30)
        except Exception:  # noqa: BLE001  (a server that would not stop: its task was cancelled)
            pass


def _answer(reply: asyncio.Future, outcome: ToolOutcome) -> None:
    if not reply.done():
        reply.set_result(outcome)


def result_outcome(name: str, result: Any, limit: int) -> ToolOutcome:
    """A `CallToolResult` as a ToolOutcome (module docstring)."""
    parts = [block.text if block.type == "text" else f"[{block.type} content not shown]" for block in result.content]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    text = "\n".join(parts)
    if len(text.encode("utf-8", "replace")) > limit:
        return ToolOutcome(kind="output", error=f"{name} returned more than {limit} bytes (rollout.tools.maxOutputBytes)")
    if result.is_error:
        return ToolOutcome(kind="reported", error=text)
    return ToolOutcome(content=text)
