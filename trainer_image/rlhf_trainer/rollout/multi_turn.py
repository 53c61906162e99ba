"""Multi-turn rollouts against a Python environment (RL2's contract).

The environment is a Python file defining

    async def step(state: str, action: str, extra_info: dict) -> dict
        # {"next_state": str, "reward": float, "score": float, "done": bool, "extra_info": dict}

`state` starts as the prompt text; `action` is the decoded text the model generated this
turn. When `state + action` is a prefix of `next_state`, the rest of `next_state` is the
environment's observation: its tokens are appended to the SAME sequence with loss mask 0,
and the model continues from there, so one trajectory stays one sequence in which only
the model's own tokens are trained on. Rewards and scores of all turns are summed. Every
turn of the trajectories of one prompt's group carries one trajectory id, so the client
keeps them on one rollout server (whose prefix cache holds the prompt and the turns so far)
while it is healthy.

Simplifications: when `next_state` does not extend `state + action` (the environment
rewrote the context) the trajectory ends there, instead of starting a second sequence as
RL2 does; observation tokens are produced by tokenizing the observation text alone (token
in, token out for the model's tokens; the observation's tokenization is the environment's).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from .client import RolloutClient, prompt_seed

StepFn = Callable[[str, str, dict], Awaitable[dict]]


def load_environment(path: str) -> StepFn:
    """Import `step` from the environment file; errors name `environment.file`."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"environment.file: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"rlhf_env_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "step", None)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(f"environment.file: {path} must define `async def step(state, action, extra_info)`")
    return fn


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the environment's."""
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    score: float = 0.0
    truncated: bool = False
    num_turns: int = 0


_KEYS = ("next_state", "reward", "done")


async def run_trajectory(client: RolloutClient, step: StepFn, tokenizer: Any, prompt_text: str,
                         prompt_ids: list[int], extra_info: dict, *, max_turns: int, max_tokens: int,
                         sampling: dict[str, Any], seed: int, trajectory_id: str | None = None) -> Trajectory:
    traj = Trajectory(list(prompt_ids))
    state = prompt_text
    info = dict(extra_info)
    for turn in range(max_turns):
        budget = max_tokens - len(traj.response_ids)
        if budget <= 0:
            traj.truncated = True
            break
        [[sample]] = await client.generate([traj.prompt_ids + traj.response_ids], n=1, max_tokens=budget,
                                           seed=prompt_seed(seed, turn), trajectory_id=trajectory_id, **sampling)
        traj.response_ids += sample.token_ids
        traj.loss_mask += [1] * len(sample.token_ids)
        traj.logprobs += sample.logprobs
        traj.num_turns += 1
        action = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        result = await step(state, action, info)
        missing = [k for k in _KEYS if k not in result]
        if missing:
            raise ValueError(f"environment step returned no {', '.join(missing)}: it must return "
                             "{next_state, reward, score, done, extra_info}")
        traj.reward += float(result["reward"])
        traj.score += float(result.get("score", result["reward"]))
        info = result.get("extra_info", info)
        if result["done"]:
            break
        if sample.finish_reason == "length" and len(traj.response_ids) >= max_tokens:
            traj.truncated = True
            break
        next_state = result["next_state"]
        if not next_state.startswith(state + action):
            break  # the environment rewrote the context: see the module docstring
        observation = next_state[len(state + action):]
        obs_ids = tokenizer(observation, add_special_tokens=False)["input_ids"] if observation else []
        if turn + 1 == max_turns or len(traj.response_ids) + len(obs_ids) >= max_tokens:
            # no model turn can follow: end on the model's tokens, so the reward (placed on
            # the last token) lands on a token that is trained on
            traj.truncated = True
            break
        traj.response_ids += obs_ids
        traj.loss_mask += [0] * len(obs_ids)
        traj.logprobs += [0.0] * len(obs_ids)
        state = next_state
    return traj


def group_id(seed: int, index: int) -> str:
    """The trajectory id of the group of prompt `index` in a call seeded with `seed` (each
    step and rollout round has its own seed, so ids do not repeat within a run)."""
    return f"{seed}:{index}"


def collect(client: RolloutClient, step: StepFn, tokenizer: Any, prompts: list[Any], *, n: int, max_turns: int,
            max_tokens: int, sampling: dict[str, Any], seed: int) -> list[list[Trajectory]]:
    """n trajectories per prompt, all run concurrently; one inner list per prompt. The
    trajectories of prompt i share the trajectory id `group_id(seed, i)`."""

    async def main() -> list[list[Trajectory]]:
        jobs = [run_trajectory(client, step, tokenizer, p.text, p.token_ids, {**p.extra_info, "answer": p.answer},
                               max_turns=max_turns, max_tokens=max_tokens, sampling=sampling,
                               seed=prompt_seed(seed, i * n + j), trajectory_id=group_id(seed, i))
                for i, p in enumerate(prompts) for j in range(n)]
        flat = await asyncio.gather(*jobs)
        return [list(flat[i * n:(i + 1) * n]) for i in range(len(prompts))]

    return client.run(main()) if hasattr(client, "run") else asyncio.run(main())  # the run's connection pool
