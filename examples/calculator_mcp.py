"""The calculator of examples/calculator_tool.py as an MCP server (`rollout.tools.mcpServers`):
the same tool name, parameter and results (its schema is the SDK's, made from the same
function), so builtin://tiny-qwen2-tools episodes render and score exactly as with the Python
tool.

    rollout:
      tools:
        mcpServers:
        - name: calculator
          command: [python, examples/calculator_mcp.py]      # stdio: the trainer starts it

Run with `--http PORT` it serves Streamable HTTP on 127.0.0.1:PORT/mcp instead
(`mcpServers: [{name: calculator, url: http://127.0.0.1:PORT/mcp}]`). Written with the MCP
Python SDK's own server (`MCPServer`); any MCP server, in any language, is given the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_tool import calculator  # noqa: E402  (the Python tool, served as it is)

server = MCPServer("calculator", log_level="WARNING")
server.add_tool(calculator, structured_output=False)  # its result is the text the tool returns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, metavar="PORT", help="serve Streamable HTTP on 127.0.0.1:PORT/mcp")
    args = parser.parse_args()
    if args.http is None:
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
