"""The preflight's reward checks: each `python` function is imported (from its file, or its
import path; a `trl.rewards.get_*` factory called with reward.kwargs) and its parameters
matched to a form (rewards/forms.py), a TRL-style function's required keywords against the
data's columns and reward.kwargs; a judge at a URL whose key is not set. Each
problem names the field, so a function a user wrote for another framework ends the job with
exit 2 before any model loads, not with exit 1 from every restarted trainer.

Importing runs the user's module (it is trusted code: the trainer imports it anyway).
Not checked: what a function returns (it runs on real responses only)."""

from __future__ import annotations

import os

from rlhf_contract.pod import ENV_JUDGE_API_KEY
from rlhf_contract.trainer_config import TrainerConfig

from ..data.datasets import peek_records
from ..rewards.forms import RewardConfigError, call_kwargs, form_of, load_function


def data_columns(config: TrainerConfig) -> set[str] | None:
    """The columns a reward function sees as keywords (a built-in task: prompt and answer);
    None where they are not known here (a path the data checks report)."""
    path = config.data.path
    if path.startswith("builtin://"):
        return {"prompt", "answer"} if path != "builtin://gem" else None
    try:
        sample = peek_records(path, split=config.data.split, config=config.data.config, limit=16)
    except (ValueError, OSError):
        return None
    return set(sample.columns) | {k for row in sample.rows if isinstance(row, dict) for k in row}


def reward_problems(config: TrainerConfig) -> list[str]:
    """One message per reward function that cannot work."""
    if config.environment is not None:
        return []  # the environment gives the rewards
    fields = [("spec.reward", config.reward)] if config.reward.type != "model" else []
    fields += [(f"spec.reward.components[{i}]", c) for i, c in enumerate(config.reward.components)]
    problems, columns = [], None
    for field, spec in fields:
        if spec.type == "python":
            if columns is None:
                columns = data_columns(config) or set()
            try:
                fn, where = load_function(spec.file, spec.function, spec.kwargs)
                form_of(fn, where, columns or None, kwargs=list(call_kwargs(spec.file, spec.function, spec.kwargs)))
            except RewardConfigError as err:
                message = str(err)
                if message.startswith("reward.kwargs: "):
                    problems.append(f"{field}.kwargs: {message.removeprefix('reward.kwargs: ')}")
                else:
                    problems.append(f"{field}.function: {message.removeprefix('reward.function: ')}")
        judge = spec.judge if spec.type == "judge" else None
        if judge is not None and judge.url and judge.api_key_secret is not None and not os.environ.get(ENV_JUDGE_API_KEY):
            problems.append(f"{field}.judge.apiKeySecret: the judge at {judge.url} needs its key and {ENV_JUDGE_API_KEY} "
                            "is not set (in Kubernetes the Secret key fills it; locally: export it)")
    return problems
