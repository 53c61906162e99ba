"""GEM environments (gem-llm) through the multi-turn `step` contract: the real GEM game,
the trainer's real trajectory code, and a scripted policy standing in for the rollout
server (it writes the guesses a model would), so the turns' loss mask can be checked
token by token: the model's guesses 1, GEM's feedback 0."""

from __future__ import annotations

import asyncio
import re
import string

import pytest

pytest.importorskip("gem")

from rlhf_trainer.rollout import gem_env  # noqa: E402
from rlhf_trainer.rollout.client import Sample  # noqa: E402
from rlhf_trainer.rollout.multi_turn import run_trajectory  # noqa: E402

ENV_ID = "game:GuessTheNumber-v0-easy"


class CharTokenizer:
    """One token per printable character: text round-trips exactly."""

    chars = string.printable
    eos_token_id = len(string.printable)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.chars.index(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chars[i] for i in ids if i < len(self.chars))


class Guesser:
    """Plays binary search from the feedback in the sequence (as a policy would)."""

    def __init__(self, tok: CharTokenizer):
        self.tok = tok

    async def generate(self, prompts, n, max_tokens, seed, **sampling):
        text = self.tok.decode(prompts[0])
        low, high = 1, 10
        for guess, direction in re.findall(r"you guessed (\d+), and the target number is (higher|lower)", text):
            if direction == "higher":
                low = max(low, int(guess) + 1)
            else:
                high = min(high, int(guess) - 1)
        ids = self.tok(f"\\boxed{{{(low + high) // 2}}}")["input_ids"]
        return [[Sample(prompts[0], ids, [-0.5] * len(ids), "stop")]]


def test_gem_turns_keep_one_sequence_with_the_feedback_masked():
    tok = CharTokenizer()
    seed = gem_env.episode_seed(0, 3)
    prompt = gem_env.initial_prompt(ENV_ID, seed)
    assert "Guess The Number" in prompt
    traj = asyncio.run(run_trajectory(Guesser(tok), gem_env.step, tok, prompt, tok(prompt)["input_ids"],
                                      {"gem_id": ENV_ID, "gem_seed": seed}, max_turns=6, max_tokens=2000,
                                      sampling={}, seed=0))
    assert traj.num_turns >= 2 and traj.reward > 0  # binary search wins within the game's turns
    model = tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 1])
    env = tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert re.fullmatch(r"(\\boxed\{\d+\})+", model)  # every trained token is the policy's own
    assert env.count("you guessed") == traj.num_turns - 1 and "\\boxed" not in env  # GEM's words, masked
    assert traj.logprobs[traj.loss_mask.index(0)] == 0.0


def test_unknown_gem_id_is_a_clear_error():
    with pytest.raises(ValueError, match=r"environment\.gem: cannot make 'game:NoSuchGame-v0'"):
        gem_env.make("game:NoSuchGame-v0")
