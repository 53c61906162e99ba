"""Agent episodes (`rollout.agent`): an agent program of one's own runs each episode against
the episode's OpenAI-compatible endpoint (agent_endpoint.py), and the trainer trains on what the
endpoint recorded.

Per collection one endpoint is served on the rollout client's event loop; each episode starts
the agent's command as its own process (its own process group), at most
`maxConcurrentEpisodes` at once, with `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `RLHF_EPISODE_ID`
in its environment (on top of the trainer's) and the episode, `{"id", "messages"}`, as one JSON
object on its stdin; its stdout is discarded and the tail of its stderr kept for the record. A
`python` first word is the trainer's own interpreter. The episode ends when the process exits:
`answer` (exit 0 after at least one call), `turn_budget` / `token_budget` (a call was refused
for a budget; truncated), `agent_failed` (a non-zero exit, or an exit without a call; the
record's `agent_error` has the status and the stderr tail), or `agent_timeout` (past
`timeoutSeconds` the process group is killed). Calls still generating when the episode ends
are answered 409 and not recorded. A failing agent ends only its own episode: the row holds
what was recorded (none: the dataset prompt and one end-of-sequence token with loss mask 0),
and `spec.reward` scores it as any other.

Simplifications: the agent runs as a process of the trainer (in its pod on a cluster), trusted
as a python reward is: not in the code sandbox, with no memory or CPU limit beyond its
wall-clock one; what it imports must be in the trainer's image.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

from rlhf_contract.api.tools import AgentSpec

from .agent_endpoint import AgentEndpoint, AgentEpisode
from .client import RolloutClient, prompt_seed
from .tool_episodes import ChatFormat, episode_metrics
from .tool_types import program_command

STDERR_TAIL_BYTES = 2000
"""How much of a failing agent's stderr its record keeps."""


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_agent(command: list[str], episode: AgentEpisode, base_url: str, messages: list[dict], *,
                    timeout_s: float) -> None:
    """Run the agent for `episode` until it exits or times out; set the episode's end."""
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": episode.key, "RLHF_EPISODE_ID": episode.id}
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
    except OSError as err:
        episode.closed, episode.end = True, "agent_failed"
        episode.error = f"rollout.agent.command could not be started: {err}"
        return
    tail = bytearray()

    async def feed() -> None:
        try:
            proc.stdin.write((json.dumps({"id": episode.id, "messages": messages}) + "\n").encode())
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):  # an agent that does not read its stdin
            pass

    async def drain() -> None:
        while chunk := await proc.stderr.read(65536):
            tail.extend(chunk)
            del tail[:-STDERR_TAIL_BYTES]

    helpers = [asyncio.ensure_future(feed()), asyncio.ensure_future(drain())]
    try:
        code: int | None = await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        code = None
    finally:
        episode.closed = True  # calls still in flight are not recorded
        _kill_group(proc)  # the agent's own children too
        await proc.wait()
    _, pending = await asyncio.wait(helpers, timeout=5)
    for task in pending:
        task.cancel()
    proc._transport.close()  # noqa: SLF001  (asyncio closes it only when garbage-collected)
    stderr = tail.decode(errors="replace").strip()
    if code is None:
        episode.end = "agent_timeout"
        episode.error = f"the agent ran past {timeout_s:g} s (rollout.agent.timeoutSeconds)"
    elif episode.budget_end:
        episode.end = episode.budget_end
        if code != 0:
            episode.error = f"exit status {code}: {stderr}"
    elif code != 0:
        episode.end, episode.error = "agent_failed", f"exit status {code}: {stderr}"
    elif not episode.segments:
        episode.end, episode.error = "agent_failed", "the agent exited without a chat completion call"
    else:
        episode.end = "answer"


def collect(client: RolloutClient, spec: AgentSpec, tokenizer: Any, prompts: list[Any], *, n: int, max_tokens: int,
            sampling: dict[str, Any], seed: int) -> list[list[AgentEpisode]]:
    """n agent episodes per prompt, at most `spec.maxConcurrentEpisodes` at once; one inner list
    per prompt."""
    command = program_command(spec.command)
    fmt = ChatFormat(tokenizer, None, field="rollout.agent")

    async def main() -> list[list[AgentEpisode]]:
        endpoint = AgentEndpoint(client, tokenizer, max_tokens=max_tokens, max_turns=spec.max_turns, sampling=sampling)
        await endpoint.start()
        limit = asyncio.Semaphore(spec.max_concurrent_episodes)

        async def one(messages: list[dict], index: int) -> AgentEpisode:
            episode = endpoint.open(f"{seed}-{index}", prompt_seed(seed, index),
                                    fmt.ids(fmt.render(messages, generation_prompt=True)))
            async with limit:
                await run_agent(command, episode, endpoint.base_url(episode), messages,
                                timeout_s=spec.timeout_seconds)
            return episode

        try:
            shown = [p.prompt if p.prompt is not None else p.text for p in prompts]
            chats = [[{"role": "user", "content": x}] if isinstance(x, str) else list(x) for x in shown]
            flat = await asyncio.gather(*(one(m, i * n + j) for i, m in enumerate(chats) for j in range(n)))
        finally:
            await endpoint.aclose()
        if endpoint.failure is not None:  # the rollout servers failed, not the agents: so does the step
            raise endpoint.failure
        return [list(flat[i * n:(i + 1) * n]) for i in range(len(prompts))]

    return client.run(main()) if hasattr(client, "run") else asyncio.run(main())


class AgentRollout:
    """A job's `rollout.agent`, for the run (the sampler's episode source, as `ToolRollout`)."""

    def __init__(self, spec: AgentSpec, tokenizer: Any):
        ChatFormat(tokenizer, None, field="rollout.agent")  # fails now without a chat template
        self.spec, self.tokenizer = spec, tokenizer

    def collect(self, client: RolloutClient, prompts: list[Any], *, n: int, max_tokens: int,
                sampling: dict[str, Any], seed: int) -> list[list[AgentEpisode]]:
        return collect(client, self.spec, self.tokenizer, prompts, n=n, max_tokens=max_tokens, sampling=sampling,
                       seed=seed)

    def metrics(self, episodes: list[AgentEpisode]) -> dict[str, float]:
        """The tools' episode metrics (tool calls, malformed calls as errors, calls per episode as
        turns), and the fraction of episodes whose agent failed or timed out."""
        return {**episode_metrics(episodes),
                "agent_failed_fraction": sum(e.end.startswith("agent_") for e in episodes) / max(1, len(episodes))}

    def close(self, client: Any = None) -> None:
        """Nothing outlives a collection (each agent process ends with its episode)."""
