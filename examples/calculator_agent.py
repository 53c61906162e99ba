"""A minimal agent program for `rollout.agent` (examples/local-agent.yaml): an OpenAI-protocol
client with a calculator tool of its own, written with the standard library alone (urllib and
json) so that a process per episode starts in a few tens of milliseconds; the same agent with
the `openai` package is examples/calculator_agent_openai.py. Nothing here knows about training.

It reads its episode, `{"id": ..., "messages": [...]}`, as one JSON object on stdin, and the
endpoint and key from OPENAI_BASE_URL and OPENAI_API_KEY (what an OpenAI client reads). It
calls the model, runs the calculator for each tool call, sends the results back, and stops
when the model answers without a call (or after a few rounds). The trainer trains on what its
endpoint recorded, not on anything this program says or returns.
"""

import json
import os
import sys
import urllib.request

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Adds up a sum of whole numbers.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": 'the sum to work out, such as "7+5".'}},
        "required": ["expression"]}}}]


def calculator(expression: str) -> str:
    terms = str(expression).split("+")
    if not all(t.strip().isdigit() for t in terms):
        return f"error: {expression!r} is not a sum of whole numbers"
    return str(sum(int(t) for t in terms))


def chat(messages: list) -> dict:
    """One chat completion: POST {OPENAI_BASE_URL}/chat/completions; an HTTP error raises."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages, "tools": TOOLS}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def main() -> None:
    episode = json.load(sys.stdin)
    messages = list(episode["messages"])
    for _ in range(3):
        message = chat(messages)["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            try:
                result = calculator(**json.loads(call["function"]["arguments"]))
            except (TypeError, json.JSONDecodeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


if __name__ == "__main__":
    main()
