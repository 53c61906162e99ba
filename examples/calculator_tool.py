"""A calculator tool for `rollout.tools` (examples/local-tools.yaml): the model sees "7+5=",
may call `calculator` with the sum, and answers (7 + 5) mod 10 from the tool's result.

A tool is a plain Python function: the model's call passes its JSON `arguments` as keywords,
and what it returns is the tool message. Its OpenAI schema is made from the type hints and
this Google-style docstring unless the job gives one (`schema`).
"""


def calculator(expression: str) -> str:
    """Adds up a sum of whole numbers.

    Args:
        expression: the sum to work out, such as "7+5".
    """
    terms = expression.split("+")
    if not all(t.strip().isdigit() for t in terms):
        return f"error: {expression!r} is not a sum of whole numbers"
    return str(sum(int(t) for t in terms))
