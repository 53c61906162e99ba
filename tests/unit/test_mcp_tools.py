"""MCP servers as tools (`rollout.tools.mcpServers`, rollout/mcp_tools.py): real MCP servers
written with the SDK's own server (examples/calculator_mcp.py, over stdio and over
Streamable HTTP, and a hostile one), the SDK's client in the trainer, the real tokenizer and
chat template of builtin://tiny-qwen2-tools, the real sampler, orchestrator and reward; a
scripted policy stands in for the rollout server (tests/unit/test_tool_episodes.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ScriptedPolicy
from rlhf_trainer.models.builtin import IM_END
from rlhf_trainer.rollout.tools import ToolConfigError, load_tools
from test_tool_episodes import call, collect, config

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "calculator_mcp.py"
HOSTILE = '''
import os, time
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

with open(os.environ["PID_LOG"], "a") as log:
    log.write(f"{os.getpid()}\\n")
server = MCPServer("hostile", log_level="CRITICAL")

@server.tool(structured_output=False)
def calculator(expression: str) -> str:
    """A calculator that misbehaves on some sums."""
    if expression == "1+1":
        time.sleep(3600)
    if expression == "2+2":
        raise ToolError("two and two is too hard")
    if expression == "3+3":
        return "6" * 1_000_000
    if expression == "4+4":
        os._exit(3)
    return str(sum(int(t) for t in expression.split("+")))

server.run("stdio")
'''


@pytest.fixture
def tok(tools_tokenizer):
    return tools_tokenizer


@pytest.fixture(scope="module")
def http_url():
    """examples/calculator_mcp.py serving Streamable HTTP on a free 127.0.0.1 port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(SERVER), "--http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the MCP HTTP server did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


def one_prompt(cfg):
    return cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": 1})})


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_an_mcp_calculator_gives_the_episode_the_python_tool_gives(transport, tok, tmp_path, request):
    """The example server's calculator, over stdio (the trainer starts it) and over HTTP: the
    row is exactly the engine's tokens with the template's tool messages (mask 0) of the
    server's results, as examples/calculator_tool.py gives them."""
    server = ({"name": "calc", "command": ["python", str(SERVER)]} if transport == "stdio"
              else {"name": "calc", "url": request.getfixturevalue("http_url")})
    cfg = one_prompt(config({"mcpServers": [server], "maxTurns": 4}))
    policy = ScriptedPolicy(tok, {"7+5=": [call("7+5") + IM_END, call("1+2") + call("3") + IM_END, "2" + IM_END]})
    batch = collect(tok, cfg, policy, [("7+5=", "2")], tmp_path)
    [row] = batch.rows
    e1, e2, e3 = policy.emitted["7+5="]
    obs1 = policy.ids("\n<|im_start|>user\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n")
    obs2 = policy.ids("\n<|im_start|>user\n<tool_response>3</tool_response>\n<tool_response>3</tool_response>"
                      "<|im_end|>\n<|im_start|>assistant\n")
    assert row.prompt_ids == policy.ids("<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n"
                                        "7+5=<|im_end|>\n<|im_start|>assistant\n")
    assert e2.prompt_token_ids == row.prompt_ids + e1.token_ids + obs1
    assert row.response_ids == e1.token_ids + obs1 + e2.token_ids + obs2 + e3.token_ids
    assert row.mask() == [1.0] * len(e1.token_ids) + [0.0] * len(obs1) + [1.0] * len(e2.token_ids) \
        + [0.0] * len(obs2) + [1.0] * len(e3.token_ids)
    assert row.rollout_logprobs == e1.logprobs + [0.0] * len(obs1) + e2.logprobs + [0.0] * len(obs2) + e3.logprobs
    assert (row.reward, row.extra) == (1.0, {"end": "answer", "turns": 3, "tool_calls": 3, "tool_errors": 0})
    [schema] = load_tools(cfg.tools)  # the server's inputSchema is the parameters the template gets
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not a zombie
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_hanging_erring_flooding_or_dying_mcp_tool_ends_only_its_episode(tok, tmp_path):
    """One episode at a time, in order: the hanging call ends its episode at the timeout and its
    server is killed; the erring call (isError) is told to the model, which goes on; the 1 MB
    result ends its episode (tool_output); the dying server ends its episode (tool_crashed);
    each next call is served by a server started afresh."""
    file, pids = tmp_path / "hostile_mcp.py", tmp_path / "pids"
    file.write_text(HOSTILE)
    server = {"name": "hostile", "command": ["python", str(file)], "env": {"PID_LOG": str(pids)}}
    prompts = [("1+1=", "2"), ("2+2=", "4"), ("3+3=", "6"), ("4+4=", "8"), ("5+5=", "0")]
    cfg = config({"mcpServers": [server], "maxTurns": 3, "timeoutSeconds": 1, "maxOutputBytes": 4096,
                  "maxConcurrentEpisodes": 1})
    cfg = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"prompts_per_step": len(prompts)})})
    scripts = {p: [call(p[:-1]) + IM_END, a + IM_END] for p, a in prompts}
    policy = ScriptedPolicy(tok, scripts)
    start = time.monotonic()
    batch = collect(tok, cfg, policy, prompts, tmp_path)
    assert time.monotonic() - start < 40  # the hour-long call was given up at 1 s
    ends = {p: (r.extra["end"], r.reward) for (p, _), r in zip(prompts, batch.rows)}
    assert ends == {"1+1=": ("tool_timeout", 0.0), "2+2=": ("answer", 1.0), "3+3=": ("tool_output", 0.0),
                    "4+4=": ("tool_crashed", 0.0), "5+5=": ("answer", 1.0)}
    assert "ran past 1 s" in batch.rows[0].extra["tool_error"]
    assert "more than 4096 bytes" in batch.rows[2].extra["tool_error"]
    erred = batch.rows[1]
    assert erred.extra == {"end": "answer", "turns": 2, "tool_calls": 1, "tool_errors": 1}
    e1, e2 = policy.emitted["2+2="]
    told = policy.ids("\n<|im_start|>user\n<tool_response>error: Error executing tool calculator: two and two is too hard"
                      "</tool_response><|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert erred.response_ids == e1.token_ids + told + e2.token_ids
    assert erred.mask() == [1.0] * len(e1.token_ids) + [0.0] * len(told) + [1.0] * len(e2.token_ids)
    for row in (batch.rows[0], batch.rows[2], batch.rows[3]):  # ended on the model's call
        assert 0.0 not in row.mask()
    # started: to list the tools, then for the calls, again after the timeout and after the crash
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 4
    assert not any(alive(pid) for pid in started)
    assert batch.stats.tools["tool_failed_fraction"] == pytest.approx(3 / 5)
    assert batch.stats.tools["tool_errors"] == 4.0


def test_what_the_model_gets_wrong_is_told_to_it(http_url):
    """A tool no server lists, and arguments the server refuses (its `isError` result), are
    answered for the model (kinds `arguments`, `reported`); neither ends the episode."""
    import asyncio

    from rlhf_contract.api.tools import ToolsSpec
    from rlhf_trainer.rollout.tools import ToolRunner, load_tool_set

    spec = ToolsSpec.model_validate({"mcpServers": [{"name": "calc", "url": http_url}]})
    runner = ToolRunner(spec, *load_tool_set(spec))

    async def calls():
        try:
            return await asyncio.gather(runner.call("abacus", {}), runner.call("calculator", {"sum": "7+5"}),
                                        runner.call("calculator", {"expression": "7+5"}))
        finally:
            await runner.aclose()

    unknown, refused, fine = asyncio.run(calls())
    assert (unknown.kind, unknown.error) == ("arguments", "no tool named 'abacus'; the tools are calculator")
    assert refused.kind == "reported" and not refused.ends_episode
    assert "expression" in refused.error and "Field required" in refused.error
    assert (fine.kind, fine.content) == (None, "12")


def test_servers_that_cannot_start_or_clash_are_config_errors(tmp_path):
    from rlhf_trainer.preflight import check

    missing = config({"mcpServers": [{"name": "calc", "command": ["no-such-mcp-server"]}]})
    with pytest.raises(ToolConfigError, match=r"rollout.tools.mcpServers\[0\]: cannot start \['no-such-mcp-server'\]"):
        load_tools(missing.tools)
    problems = check(missing, 1)
    assert any(p.startswith("spec.rollout.tools.mcpServers[0]: cannot start") for p in problems), problems
    twice = config({"functions": [{"file": str(ROOT / "examples" / "calculator_tool.py"), "function": "calculator"}],
                    "mcpServers": [{"name": "calc", "command": ["python", str(SERVER)]}]})
    with pytest.raises(ToolConfigError, match=r"mcpServers\[0\]: its tool 'calculator' has the name of "
                                              r"rollout.tools.functions\[0\]'s"):
        load_tools(twice.tools)
    unlisted = config({"mcpServers": [{"name": "calc", "command": ["python", str(SERVER)], "tools": ["abacus"]}]})
    with pytest.raises(ToolConfigError, match=r"mcpServers\[0\].tools: the server lists no tool 'abacus'"):
        load_tools(unlisted.tools)


def test_the_job_spec_names_what_to_change():
    with pytest.raises(Exception, match="give functions .* or mcpServers"):
        config({"maxTurns": 2})
    with pytest.raises(Exception, match="either command .* or url"):
        config({"mcpServers": [{"name": "calc", "command": ["python", "s.py"], "url": "http://h/mcp"}]})
    with pytest.raises(Exception, match="carries a credential"):
        config({"mcpServers": [{"name": "calc", "url": "http://user:pw@h/mcp"}]})
    with pytest.raises(Exception, match=r"names \['calc'\] appear more than once"):
        config({"mcpServers": [{"name": "calc", "url": "http://h/mcp"}, {"name": "calc", "url": "http://g/mcp"}]})
