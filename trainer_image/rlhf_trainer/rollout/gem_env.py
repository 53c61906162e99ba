"""GEM environments (the `gem-llm` package; RL2 runs its agentic tasks on them) through the
multi-turn `step` contract of multi_turn.py (`environment.gem: <env id>`).

Prompts (`data.path: builtin://gem`): example i is `env.reset(seed)` of a fresh
environment, seed a function of (job seed, i), so a resumed run sees the same episodes.
Each trajectory keeps its own environment instance in its `extra_info` (created on its
first turn from the same id and seed, so it is in the state its prompt showed). A GEM
`step(action)` returns (observation, reward, terminated, truncated, info); the observation
and GEM's `info["suffix"]` (the instruction for the next turn) are appended to the
sequence as the environment's tokens (loss mask 0), and the episode ends when GEM says
terminated or truncated. Rewards of all turns are summed (as for any environment).
"""

from __future__ import annotations

import logging
import random
import warnings
from typing import Any

log = logging.getLogger(__name__)

_ENV = "_gem_env"  # key of the live environment in a trajectory's extra_info


def make(env_id: str):
    """A new GEM environment; a clear error when the package or the id is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import gem
    except ImportError as err:
        raise ValueError("environment.gem: the gem-llm package is not installed in the trainer "
                         "(pip install 'rlhf-operator[gem]')") from err
    try:
        return gem.make(env_id)
    except Exception as err:  # gem raises its own error types for unknown ids
        raise ValueError(f"environment.gem: cannot make {env_id!r}: {type(err).__name__}: {err}") from None


def episode_seed(job_seed: int, index: int) -> int:
    return random.Random(f"{job_seed}:gem:{index}").randrange(2**31)


def initial_prompt(env_id: str, seed: int) -> str:
    observation, _ = make(env_id).reset(seed=seed)
    return observation


async def step(state: str, action: str, extra_info: dict) -> dict[str, Any]:
    env = extra_info.get(_ENV)
    if env is None:
        env = make(extra_info["gem_id"])
        env.reset(seed=extra_info["gem_seed"])
    observation, reward, terminated, truncated, info = env.step(action)
    suffix = (info or {}).get("suffix", "")
    next_state = state + action + "\n" + observation + ("\n" + suffix if suffix else "") + "\n"
    return {"next_state": next_state, "reward": float(reward), "score": float(reward),
            "done": bool(terminated or truncated), "extra_info": {**extra_info, _ENV: env}}
