"""The child process that runs tool calls (`python tool_worker.py`): started and killed by
`tools.ToolRunner`, never imported by the trainer (it needs the standard library alone).

Protocol, one JSON object per line: the first line on stdin lists the tools
(`[{"name", "file", "function"}]`, and `max_output_bytes`); then each request
`{"name", "arguments"}` gets one reply on the process's original stdout:
`{"ok": true, "content": str}` or `{"ok": false, "kind": ..., "error": str}` with kind
`arguments` (no such tool, or arguments that do not fit its parameters: the model's
mistake), `raised` (the tool raised), `output` (it returned or printed more than
`max_output_bytes`). What a tool prints goes to a capped buffer (file descriptors 1 and 2
point at /dev/null, so nothing it writes can corrupt the replies); a tool that returns None
answers what it printed. Timeouts are the parent's: it kills this process group.
"""

from __future__ import annotations

import importlib.util
import inspect
import io
import json
import os
import sys
import traceback


class OutputLimit(BaseException):
    """Raised inside a tool that printed past the cap (a BaseException: `except Exception`
    in the tool does not swallow it)."""


class CappedText(io.TextIOBase):
    def __init__(self, limit: int):
        self.limit, self.parts, self.size = limit, [], 0

    def write(self, text: str) -> int:
        self.size += len(text.encode("utf-8", "replace"))
        if self.size > self.limit:
            raise OutputLimit()
        self.parts.append(text)
        return len(text)

    def value(self) -> str:
        return "".join(self.parts)


def load(tools: list[dict]) -> dict:
    functions = {}
    for i, tool in enumerate(tools):
        spec = importlib.util.spec_from_file_location(f"rlhf_user_tool_{i}", tool["file"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        functions[tool["name"]] = getattr(module, tool["function"])
    return functions


def call(functions: dict, request: dict, limit: int) -> dict:
    fn = functions.get(request.get("name"))
    if fn is None:
        return {"ok": False, "kind": "arguments", "error": f"no tool named {request.get('name')!r}; "
                f"the tools are {', '.join(sorted(functions))}"}
    arguments = request.get("arguments")
    if not isinstance(arguments, dict):
        return {"ok": False, "kind": "arguments", "error": "arguments must be a JSON object"}
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as err:
        return {"ok": False, "kind": "arguments", "error": f"{request['name']}: {err}"}
    printed = CappedText(limit)
    sys.stdout = sys.stderr = printed
    try:
        value = fn(**arguments)
    except OutputLimit:
        return {"ok": False, "kind": "output", "error": f"the tool printed more than {limit} bytes"}
    except Exception as err:
        return {"ok": False, "kind": "raised", "error": "".join(traceback.format_exception_only(err)).strip()[-2000:]}
    finally:
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    content = printed.value() if value is None else value if isinstance(value, str) else json.dumps(value, default=str)
    if len(content.encode("utf-8", "replace")) > limit:
        return {"ok": False, "kind": "output", "error": f"the tool returned more than {limit} bytes"}
    return {"ok": True, "content": content}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    setup = json.loads(sys.stdin.readline())
    limit = int(setup["max_output_bytes"])
    functions = load(setup["tools"])
    replies.write(json.dumps({"ok": True, "ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        reply = call(functions, json.loads(line), limit)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
