"""Tool-calling episodes (`rollout.tools`): model turns and tool messages in ONE token
sequence, token in, token out.

An episode starts from the prompt rendered by the tokenizer's chat template with the tools
(`apply_chat_template(messages, tools=schemas, add_generation_prompt=True)`). Each model
turn is generated from the sequence so far (token ids), and its tokens and log-probs are
kept exactly as the engine returned them (loss mask 1). When the turn's decoded text holds
Hermes / Qwen `<tool_call>`s, each call runs (tools.ToolRunner) and the tool messages are
appended as the tokens of what the TEMPLATE writes for them: `ChatFormat.tool_turn_ids`
renders a fixed two-turn conversation with and without the tool messages (and the next
generation prompt) and tokenizes only the difference, plus whatever the template writes
after an assistant turn that the model did not generate itself (Qwen's newline after
`<|im_end|>`). Those tokens carry loss mask 0 and log-prob 0; earlier turns are never
re-tokenized. The episode ends when the model answers without a call (reason `answer`), at
`maxTurns` (`turn_budget`) or `rollout.maxTokens` (`token_budget`) (both count as truncated),
or when a tool call fails in a way that is not the model's mistake (`tool_timeout`,
`tool_raised`, `tool_output`, `tool_crashed`). An episode always ends on the model's own
tokens (the reward sits on the last token); `spec.reward` scores the content of its last
turn (what the model answered, text before any call). A call the model got wrong (unknown
tool, bad JSON, arguments that do not fit), or that an MCP tool answered with `isError`, is
answered with an error tool message and counted in `tool_errors`, and the episode goes on.

Simplifications: the parser knows the Hermes / Qwen format only; the template's delta is
measured on a stand-in conversation, so a template whose tool-message text depends on
earlier turns (beyond the Qwen family's grouping of consecutive tool messages) is not
rendered exactly; the reward sees the last turn's content, not the whole conversation.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rlhf_contract.api.tools import ToolsSpec

from .client import RolloutClient, prompt_seed
from .tools import ToolRunner, load_tool_set, parse_tool_calls

_STAND_IN = [{"role": "user", "content": "\x00user\x00"}, {"role": "assistant", "content": "\x00assistant\x00"}]


class ChatFormat:
    """The tokenizer's chat template with `tools`: prompt tokens and tool-message tokens."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None, field: str = "rollout.tools"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{field} needs a model whose tokenizer has a chat template that renders tools "
                             "(e.g. Qwen 2.5 and later, Hermes, or builtin://tiny-qwen2-tools)")
        self.tokenizer, self.tools = tokenizer, tools
        base = self.render(_STAND_IN)
        self.after_assistant = base.split(_STAND_IN[1]["content"], 1)[1]
        """What the template writes after an assistant turn's content (`<|im_end|>\\n`)."""

    def render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def prompt_ids(self, prompt: str | list[dict]) -> list[int]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return self.ids(self.render(messages, generation_prompt=True))

    def tool_turn_ids(self, contents: list[str], generated: list[int]) -> list[int]:
        """Tokens after a model turn `generated` that called tools: the rest of the assistant
        turn's closing the model did not write, the tool messages `contents`, the next
        generation prompt."""
        return self.continuation_ids([{"role": "tool", "content": c} for c in contents], generated)

    def continuation_ids(self, messages: list[dict], generated: list[int]) -> list[int]:
        """Tokens after a model turn `generated`: the rest of its closing the model did not
        write, what the template writes for the following `messages` (tool results, a user
        turn), the next generation prompt."""
        base = self.render(_STAND_IN)
        full = self.render(_STAND_IN + list(messages), generation_prompt=True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier turns differently once tool messages follow; "
                             "tool-calling rollouts need a template that appends tool messages")
        closing = self.after_assistant
        last = self.tokenizer.decode(generated[-1:], skip_special_tokens=False) if generated else ""
        if last and closing.startswith(last):  # the model ended its turn itself (Qwen's <|im_end|>)
            closing = closing[len(last):]
        return self.ids(closing + full[len(base):])


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    answer: str = ""
    """The content of the last model turn (what the reward scores)."""
    answer_ids: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = ""
    """answer, turn_budget, token_budget, or tool_<kind> (tools.ENDING_KINDS)."""
    error: str = ""
    """The failing tool call's message, when a tool ended the episode."""

    @property
    def truncated(self) -> bool:
        return self.end in ("turn_budget", "token_budget")

    def record(self) -> dict[str, Any]:
        """The episode's facts for its rollout record (`Row.extra`)."""
        return {"end": self.end, "turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                **({"tool_error": self.error} if self.error else {})}


async def run_episode(client: RolloutClient, runner: ToolRunner, fmt: ChatFormat, prompt_ids: list[int], *,
                      max_turns: int, max_tokens: int, sampling: dict[str, Any], seed: int) -> Episode:
    ep = Episode(list(prompt_ids))
    decode = fmt.tokenizer.decode
    for turn in range(max_turns):
        budget = max_tokens - len(ep.response_ids)
        [[sample]] = await client.generate([ep.prompt_ids + ep.response_ids], n=1, max_tokens=budget,
                                           seed=prompt_seed(seed, turn), **sampling)
        ep.response_ids += sample.token_ids
        ep.loss_mask += [1] * len(sample.token_ids)
        ep.logprobs += sample.logprobs
        ep.turns += 1
        ep.answer, calls = parse_tool_calls(decode(sample.token_ids, skip_special_tokens=True))
        ep.answer_ids = list(sample.token_ids)
        if not calls:
            ep.end = "token_budget" if sample.finish_reason == "length" else "answer"
            return ep
        if sample.finish_reason == "length" or turn + 1 == max_turns:
            ep.end = "token_budget" if sample.finish_reason == "length" else "turn_budget"
            return ep
        contents = []
        for call in calls:
            ep.tool_calls += 1
            if call.error is not None:
                ep.tool_errors += 1
                contents.append(f"error: {call.error}")
                continue
            outcome = await runner.call(call.name, call.arguments)
            if outcome.kind is not None:
                ep.tool_errors += 1
                if outcome.ends_episode:
                    ep.end, ep.error = f"tool_{outcome.kind}", outcome.error
                    return ep
                contents.append(f"error: {outcome.error}")
            else:
                contents.append(outcome.content)
        observation = fmt.tool_turn_ids(contents, sample.token_ids)
        if len(ep.response_ids) + len(observation) >= max_tokens:
            ep.end = "token_budget"  # no model turn could follow: end on the model's tokens
            return ep
        ep.response_ids += observation
        ep.loss_mask += [0] * len(observation)
        ep.logprobs += [0.0] * len(observation)
    raise AssertionError("unreachable: the last turn returns")


def collect(client: RolloutClient, runner: ToolRunner, fmt: ChatFormat, prompts: list[Any], *, n: int,
            max_turns: int, max_tokens: int, max_concurrent: int, sampling: dict[str, Any],
            seed: int) -> list[list[Episode]]:
    """n episodes per prompt, at most `max_concurrent` at once; one inner list per prompt."""

    async def main() -> list[list[Episode]]:
        limit = asyncio.Semaphore(max_concurrent)

        async def one(prompt_ids: list[int], index: int) -> Episode:
            async with limit:
                return await run_episode(client, runner, fmt, prompt_ids, max_turns=max_turns, max_tokens=max_tokens,
                                         sampling=sampling, seed=prompt_seed(seed, index))

        rendered = [fmt.prompt_ids(p.prompt if p.prompt is not None else p.text) for p in prompts]
        flat = await asyncio.gather(*(one(ids, i * n + j) for i, ids in enumerate(rendered) for j in range(n)))
        return [list(flat[i * n:(i + 1) * n]) for i in range(len(prompts))]

    if hasattr(client, "run"):  # the run's event loop: the workers live on across steps
        return client.run(main())

    async def once() -> list[list[Episode]]:  # a loop of its own: the workers end with it
        try:
            return await main()
        finally:
            await runner.aclose()

    return asyncio.run(once())


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The step's tool metrics: per-episode means of tool calls and turns, tool errors (model
    mistakes and failures), and the fraction of episodes a failing tool ended."""
    n = max(1, len(episodes))
    return {"tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
            "tool_errors": float(sum(e.tool_errors for e in episodes)),
            "turns_mean": sum(e.turns for e in episodes) / n,
            "tool_failed_fraction": sum(e.end.startswith("tool_") for e in episodes) / n}


class ToolRollout:
    """A job's `rollout.tools`: the schemas, the chat format and the worker pool (and MCP
    servers' sessions), for the run."""

    def __init__(self, spec: ToolsSpec, tokenizer: Any):
        self.spec = spec
        self.schemas, servers = load_tool_set(spec)
        self.format = ChatFormat(tokenizer, self.schemas)
        self.runner = ToolRunner(spec, self.schemas, servers)

    def collect(self, client: RolloutClient, prompts: list[Any], *, n: int, max_tokens: int,
                sampling: dict[str, Any], seed: int) -> list[list[Episode]]:
        return collect(client, self.runner, self.format, prompts, n=n, max_turns=self.spec.max_turns,
                       max_tokens=max_tokens, max_concurrent=self.spec.max_concurrent_episodes, sampling=sampling,
                       seed=seed)

    def metrics(self, episodes: list[Episode]) -> dict[str, float]:
        return episode_metrics(episodes)

    def close(self, client: Any = None) -> None:
        """End the tool workers, on `client`'s event loop when it has one (before it stops)."""
        loop = self.runner.loop
        if loop is not None and loop.is_running() and hasattr(client, "run"):
            client.run(self.runner.aclose())
        else:
            self.runner.close()
