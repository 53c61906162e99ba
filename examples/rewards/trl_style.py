"""Reward functions written as TRL's GRPOTrainer takes them (batched, keyword arguments,
one float or None per completion), used by rlhf-operator as they are:

    reward: {type: python, file: examples/rewards/trl_style.py, function: exact_answer}
    reward: {type: python, function: "trl_style:exact_answer"}   # the module on PYTHONPATH

`answer` is the data's answer column (the built-in tasks have `prompt` and `answer`)."""


def exact_answer(completions, answer, **kwargs):
    """1.0 when the completion (text, or a chat completion's assistant turn) is the answer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text.strip() == str(gold).strip()) for text, gold in zip(texts, answer)]


def digits_only(completions, **kwargs):
    """1.0 for an all-digit completion; None (does not apply) for an empty one."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(text.strip().isdigit()) if text.strip() else None for text in texts]
