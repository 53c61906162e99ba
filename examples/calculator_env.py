"""A multi-turn environment with a calculator tool, for the built-in `sum-mod-10` task.

The model sees "7+5=" and may call the calculator by writing an expression with "+":
the environment appends "=<sum of the digits mod 10>:" and the model continues in the same
sequence. Any other action is the final answer: reward 1 when it equals the answer.
Contract (RL2's): `async def step(state, action, extra_info) -> {next_state, reward, score,
done, extra_info}`; `extra_info` carries the data row's columns and `answer`.
"""

MAX_CALLS = 3


async def step(state: str, action: str, extra_info: dict) -> dict:
    calls = extra_info.get("calls", 0)
    if "+" in action and calls < MAX_CALLS:
        digits = [int(c) for c in action if c.isdigit()]
        observation = f"={sum(digits) % 10}:"
        return {"next_state": state + action + observation, "reward": 0.0, "score": 0.0, "done": False,
                "extra_info": {**extra_info, "calls": calls + 1}}
    correct = float(action.strip() == str(extra_info["answer"]))
    return {"next_state": state + action, "reward": correct, "score": correct, "done": True,
            "extra_info": extra_info}
