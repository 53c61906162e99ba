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


def exact_answer_logged(completions, answer, trainer_state, log_metric, log_extra, correct=1.0, **kwargs):
    """`exact_answer` times `correct` (from `reward.kwargs`), using TRL's context keywords as
    TRL's GRPOTrainer passes them: the run's progress read from `trainer_state` and logged with
    `log_metric` (`reward/<name>/progress`, `reward/<name>/global_step` in metrics.jsonl), the
    batch's accuracy likewise, and the gold answer as a column of the samples table
    (`log_extra`).

        reward: {type: python, file: examples/rewards/trl_style.py, function: exact_answer_logged,
                 kwargs: {correct: 2.0}}
    """
    rewards = exact_answer(completions, answer)
    log_metric("global_step", trainer_state.global_step)
    log_metric("progress", trainer_state.global_step / max(1, trainer_state.max_steps))
    log_metric("accuracy", sum(rewards) / len(rewards))
    log_extra("gold", [str(a) for a in answer])
    return [correct * r for r in rewards]
