"""The OpenAI-compatible chat completions endpoint of agent episodes (`rollout.agent`), and what
it records: the exact token ids and log-probs of every call, per episode.

One aiohttp server per collection, on loopback, on the rollout client's event loop; each episode
has its own base URL, `http://127.0.0.1:<port>/episodes/<id>/v1`, and its own API key (a call
with another episode's key is refused, 401). `POST .../chat/completions` takes OpenAI's request
(`messages`, `tools`; `max_tokens` / `max_completion_tokens` may lower the episode's budget; the
job's sampling settings are used, not the request's; `n` must be 1, no streaming) and answers in
OpenAI's shape (`choices[0].message` with `content` and `tool_calls`, `finish_reason` `stop`,
`length` or `tool_calls`, `usage`).

What is recorded, per episode, is a list of segments. A call whose `messages` (and `tools`)
continue the current segment's conversation (the messages recorded so far, each reply as the
endpoint gave it; compared by role, content and tool calls' names and arguments) is generated
from the segment's recorded tokens plus the tokens the chat template writes for the new messages
(`ChatFormat.continuation_ids`: tool results, a user turn; loss mask 0, log-prob 0); recorded
turns are never re-tokenised. Any other call (the first; a rewritten history; other tools) opens
a new segment from the template's rendering of its messages with its tools. The model's tokens
carry loss mask 1 and the engine's log-probs. Tool calls are read from the model's text in the
Hermes / Qwen format (tools.py `parse_tool_calls`); a malformed call is counted in `tool_errors`
and the reply's content is then the model's whole text (the malformed call's text included).

Budgets: `rollout.maxTokens` counts a segment's tokens after its prompt (as for `rollout.tools`);
a call that leaves no room is refused (HTTP 400, `context_length_exceeded`) and the episode is
truncated (`token_budget`); so is a call past `rollout.agent.maxTurns` (`turn_budget`).
Simplifications: calls of one episode are served one at a time (concurrent calls of one agent
queue); a failing generation request is answered 502 and fails the collection (as the servers'
fault, not the agent's: `AgentEndpoint.failure`); the template's rendering of new messages is
measured on a stand-in conversation (as for `rollout.tools`); a template that cannot render the
new messages after the recorded turns opens a new segment.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .client import prompt_seed
from .tool_episodes import ChatFormat
from .tools import parse_tool_calls

MAX_BODY_BYTES = 64 * 2**20


def chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates take them: text content (parts joined, None as ""),
    tool-call arguments as JSON objects rather than strings."""
    out = []
    for message in messages:
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        elif content is None:
            m["content"] = ""
        calls = []
        for call in m.get("tool_calls") or []:
            function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": function} if isinstance(call, dict) else call)
        m.pop("tool_calls", None)
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


def _same(message: dict) -> tuple:
    """What must be equal for a message to be the recorded one."""
    functions = [c.get("function") or {} for c in message.get("tool_calls", []) if isinstance(c, dict)]
    calls = tuple((f.get("name"), json.dumps(f.get("arguments"), sort_keys=True)) for f in functions)
    return message.get("role"), message.get("content") or "", calls


@dataclass
class Segment:
    """One conversation the endpoint recorded: its prompt tokens and everything after them."""

    prompt_ids: list[int]
    tools: list[dict] | None
    format: ChatFormat
    messages: list[dict] = field(default_factory=list)
    """The conversation so far (template form): the last call's messages and the reply."""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last_generated: list[int] = field(default_factory=list)

    def continues(self, messages: list[dict], tools: list[dict] | None) -> bool:
        n = len(self.messages)
        return (tools == self.tools and len(messages) >= n
                and [_same(m) for m in messages[:n]] == [_same(m) for m in self.messages])


@dataclass
class AgentEpisode:
    """One episode's record; the sampler trains on its LAST segment (module docstring)."""

    id: str
    key: str
    seed: int
    fallback_prompt_ids: list[int]
    """The dataset prompt's tokens: the row of an episode that recorded no call."""
    eos: int
    segments: list[Segment] = field(default_factory=list)
    answer: str = ""
    """The content of the last reply (what the reward scores)."""
    answer_ids: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = ""
    """answer, turn_budget, token_budget, agent_timeout or agent_failed."""
    budget_end: str = ""
    """turn_budget or token_budget once a call was refused for a budget."""
    error: str = ""
    closed: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @property
    def truncated(self) -> bool:
        return self.end in ("turn_budget", "token_budget")

    @property
    def last_segment(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    @property
    def prompt_ids(self) -> list[int]:
        return self.last_segment.prompt_ids if self.last_segment else list(self.fallback_prompt_ids)

    @property
    def response_ids(self) -> list[int]:
        return self.last_segment.response_ids if self.last_segment else [self.eos]

    @property
    def loss_mask(self) -> list[int]:
        return self.last_segment.loss_mask if self.last_segment else [0]

    @property
    def logprobs(self) -> list[float]:
        return self.last_segment.logprobs if self.last_segment else [0.0]

    @property
    def conversation(self) -> list[dict]:
        """The recorded conversation of the trained segment (what the reward gets)."""
        return list(self.last_segment.messages) if self.last_segment else []

    def record(self) -> dict[str, Any]:
        """The episode's facts for its rollout record (`Row.extra`)."""
        return {"end": self.end, "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "segments": len(self.segments), **({"agent_error": self.error} if self.error else {})}


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": code}},
                             status=status)


class AgentEndpoint:
    """The chat completions endpoint of one collection's episodes (module docstring)."""

    def __init__(self, client: Any, tokenizer: Any, *, max_tokens: int, max_turns: int, sampling: dict[str, Any]):
        self.client, self.tokenizer = client, tokenizer
        self.max_tokens, self.max_turns, self.sampling = max_tokens, max_turns, sampling
        self.episodes: dict[str, AgentEpisode] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.failure: BaseException | None = None
        """The first generation request that failed (the servers', not an agent's fault)."""

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/episodes/{id}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{id}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, episode_id: str, seed: int, fallback_prompt_ids: list[int]) -> AgentEpisode:
        eos = self.tokenizer.eos_token_id
        episode = AgentEpisode(episode_id, secrets.token_urlsafe(18), seed, fallback_prompt_ids, eos or 0)
        self.episodes[episode_id] = episode
        return episode

    def base_url(self, episode: AgentEpisode) -> str:
        return f"{self.url}/episodes/{episode.id}/v1"

    def _episode(self, request: web.Request) -> AgentEpisode | None:
        episode = self.episodes.get(request.match_info["id"])
        given = request.headers.get("Authorization", "")
        if episode is None or not secrets.compare_digest(given.encode(), f"Bearer {episode.key}".encode()):
            return None
        return episode

    async def _models(self, request: web.Request) -> web.Response:
        if self._episode(request) is None:
            return _error(401, "unknown episode or wrong API key", "invalid_api_key")
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rlhf"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        episode = self._episode(request)
        if episode is None:
            return _error(401, "unknown episode or wrong API key", "invalid_api_key")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return _error(400, "messages must be a non-empty list of {role, content} objects")
        if body.get("stream"):
            return _error(400, "streaming is not supported by this endpoint; call without stream")
        if body.get("n", 1) not in (1, None):
            return _error(400, "n must be 1")
        tools = body.get("tools") or None
        requested = body.get("max_completion_tokens") or body.get("max_tokens")
        async with episode.lock:  # one call of an episode at a time
            if episode.closed:
                return _error(409, "the episode has ended")
            return await self._complete(episode, chat_messages(messages), tools, requested, body.get("model"))

    async def _complete(self, episode: AgentEpisode, messages: list[dict], tools: list[dict] | None,
                        requested: Any, model: Any) -> web.Response:
        if episode.turns >= self.max_turns:
            episode.budget_end = "turn_budget"
            return _error(400, f"the episode's {self.max_turns} calls are used up (rollout.agent.maxTurns)",
                          "turn_budget")
        segment = episode.last_segment
        delta: list[int] = []
        if segment is not None and segment.continues(messages, tools):
            try:
                delta = segment.format.continuation_ids(messages[len(segment.messages):], segment.last_generated)
            except ValueError:
                segment = None
        else:
            segment = None
        if segment is None:
            try:
                fmt = ChatFormat(self.tokenizer, tools, field="rollout.agent")
                segment = Segment(fmt.ids(fmt.render(messages, generation_prompt=True)), tools, fmt)
            except Exception as err:  # jinja2's TemplateError and the like: the request's fault
                return _error(400, f"the chat template cannot render these messages ({err})")
        room = self.max_tokens - len(segment.response_ids) - len(delta)
        if room < 1:
            episode.budget_end = "token_budget"
            return _error(400, f"the episode's {self.max_tokens} tokens are used up (rollout.maxTokens)",
                          "context_length_exceeded")
        limit = min(room, int(requested)) if isinstance(requested, int) and requested > 0 else room
        prompt = segment.prompt_ids + segment.response_ids + delta
        try:
            [[sample]] = await self.client.generate([prompt], n=1, max_tokens=limit,
                                                    seed=prompt_seed(episode.seed, episode.turns),
                                                    trajectory_id=episode.id, **self.sampling)
        except Exception as err:  # RolloutError and the like: the step fails with it (collect re-raises)
            self.failure = self.failure or err
            return _error(502, f"the rollout servers failed: {err}")
        if episode.closed:  # ended (timed out) while this call was generating: keep the record as it was
            return _error(409, "the episode has ended")
        if segment is not episode.last_segment:
            episode.segments.append(segment)
        segment.response_ids += delta + list(sample.token_ids)
        segment.loss_mask += [0] * len(delta) + [1] * len(sample.token_ids)
        segment.logprobs += [0.0] * len(delta) + list(sample.logprobs)
        segment.last_generated = list(sample.token_ids)
        episode.turns += 1
        if sample.finish_reason == "length" and limit == room:
            episode.budget_end = "token_budget"
        message, finish = self._reply(episode, sample)
        segment.messages = messages + chat_messages([message])
        return web.json_response({
            "id": f"chatcmpl-{episode.id}-{episode.turns}", "object": "chat.completion", "created": int(time.time()),
            "model": model if isinstance(model, str) else "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sample.token_ids),
                      "total_tokens": len(prompt) + len(sample.token_ids)}})

    def _reply(self, episode: AgentEpisode, sample: Any) -> tuple[dict, str]:
        """The OpenAI message of a generated turn, and its finish reason."""
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        content, calls = parse_tool_calls(text)
        valid = [c for c in calls if c.error is None]
        episode.tool_calls += len(calls)
        episode.tool_errors += len(calls) - len(valid)
        if len(valid) < len(calls):
            content = text.strip()
        episode.answer, episode.answer_ids = content, list(sample.token_ids)
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if valid:
            message["tool_calls"] = [{"id": f"call_{episode.turns}_{k}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for k, c in enumerate(valid)]
        finish = "tool_calls" if valid else ("length" if sample.finish_reason == "length" else "stop")
        return message, finish
