"""examples/calculator_agent.py with the `openai` package (an ordinary OpenAI
client; `import openai` costs about half a second a process). Nothing here knows about training.

It reads its episode, `{"id": ..., "messages": [...]}`, as one JSON object on stdin; the
client takes the endpoint and key from OPENAI_BASE_URL and OPENAI_API_KEY, as it always does.
It calls the model, runs the calculator for each tool call, sends the results back, and stops
when the model answers without a call (or after a few rounds). The trainer trains on what its
endpoint recorded, not on anything this program says or returns.
"""

import json
import sys

from openai import OpenAI

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


def main() -> None:
    episode = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages = list(episode["messages"])
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except (TypeError, json.JSONDecodeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
