"""The advantage estimators (algorithms/advantages.py) and the DAPO pieces, each against a
plain loop written from the paper's equation."""

import math
import random

import pytest
import torch

from algorithm_cases import random_mask
from rlhf_trainer.algorithms.advantages import (compute_advantages, discounted_returns, gae, groups_with_signal,
                                                masked_whiten, overlong_penalty)


def loop_advantages(estimator, rewards, lengths, group):
    out = []
    for g in range(0, len(rewards), group):
        rs = rewards[g:g + group]
        mean = sum(rs) / group
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (group - 1)) if group > 1 else 0.0
        for i, r in enumerate(rs):
            if estimator == "grpo":
                a = (r - mean) / (std + 1e-6)
            elif estimator == "dr_grpo":
                a = r - mean
            else:  # rloo: r minus the mean of the others
                a = r - (sum(rs) - r) / (group - 1)
            out.append(a)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_loop(seed, estimator):
    gen = torch.Generator().manual_seed(seed)
    b, t, group = 12, 5, 4
    mask = random_mask(b, t, gen)
    mask[group:2 * group, 0] = 1  # group 1: identical rewards on non-empty responses
    token_rewards = torch.zeros(b, t, dtype=torch.float64)
    rewards = []
    rng = random.Random(seed)
    for i in range(b):
        n = int(mask[i].sum())
        r = rng.choice([0.0, 1.0, 0.5])
        if i // group == 1:
            r = 1.0  # a group of identical rewards -> zero advantage
        if n:
            token_rewards[i, n - 1] = r
        rewards.append(r if n else 0.0)
    adv = compute_advantages(estimator, token_rewards, mask, group_size=group)
    want = loop_advantages(estimator, rewards, None, group)
    for i in range(b):
        for j in range(t):
            expected = want[i] if mask[i, j] else 0.0
            assert adv[i, j].item() == pytest.approx(expected, abs=1e-9)
    assert adv[group:2 * group].abs().max() == 0


def test_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages("grpo", torch.zeros(6, 2), torch.ones(6, 2), group_size=4)


def loop_whiten(xs):
    """xs: list of valid values -> whitened list (unbiased std)."""
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / max(n - 1, 1))
    return [(x - mean) / (std + 1e-8) for x in xs]


def random_batch(seed, b=6, t=5):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(b, t, gen)
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(b, t, generator=gen, dtype=torch.float64) * mask
    return mask, rewards, values


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.99, 0.0)])
def test_gae_matches_loop(seed, gamma, lam):
    mask, rewards, values = random_batch(seed)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        a_next = 0.0
        for t in reversed(range(mask.shape[1])):
            if t >= n:
                assert adv[i, t] == 0 and ret[i, t] == 0
                continue
            v_next = values[i, t + 1].item() if t + 1 < n else 0.0  # last valid token is terminal
            delta = rewards[i, t].item() + gamma * v_next - values[i, t].item()
            a = delta + gamma * lam * a_next
            assert adv[i, t].item() == pytest.approx(a, abs=1e-10)
            assert ret[i, t].item() == pytest.approx(a + values[i, t].item(), abs=1e-10)
            a_next = a
    whitened = compute_advantages("gae", rewards, mask, values=values, gamma=gamma, lam=lam, norm_std=True)
    valid = [adv[i, t].item() for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    got = [whitened[i, t].item() for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    assert got == pytest.approx(loop_whiten(valid), abs=1e-9)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_matches_loop(seed):
    mask, rewards, _ = random_batch(seed)
    gamma = 0.9
    returns = discounted_returns(rewards, mask, gamma)
    valid = []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        for t in range(n):
            g = sum(gamma ** (k - t) * rewards[i, k].item() for k in range(t, n))
            assert returns[i, t].item() == pytest.approx(g, abs=1e-10)
            valid.append(g)
    adv = compute_advantages("reinforce_pp", rewards, mask, gamma=gamma)
    got = [adv[i, t].item() for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    assert got == pytest.approx(loop_whiten(valid), abs=1e-9)
    assert (adv * (1 - mask)).abs().max() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_pp_baseline_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    b, t, group = 8, 4, 4
    mask = random_mask(b, t, gen)
    mask[:, 0] = 1
    token_rewards = torch.zeros(b, t, dtype=torch.float64)
    rs = []
    for i in range(b):
        r = float(torch.randint(0, 2, (1,), generator=gen))
        token_rewards[i, int(mask[i].sum()) - 1] = r
        rs.append(r)
    adv = compute_advantages("reinforce_pp_baseline", token_rewards, mask, group_size=group)
    centered = [rs[i] - sum(rs[i // group * group:(i // group + 1) * group]) / group for i in range(b)]
    valid = [centered[i] for i in range(b) for tt in range(t) if mask[i, tt]]
    got = [adv[i, tt].item() for i in range(b) for tt in range(t) if mask[i, tt]]
    assert got == pytest.approx(loop_whiten(valid), abs=1e-9)


def test_whitening_of_an_all_masked_batch_is_zero():
    assert masked_whiten(torch.ones(2, 3), torch.zeros(2, 3)).abs().max() == 0


def test_overlong_penalty_is_piecewise_linear():
    lengths = torch.tensor([0, 10, 12, 14, 16, 20])
    got = overlong_penalty(lengths, max_len=16, cache_len=4).tolist()
    want = []
    for n in lengths.tolist():
        if n <= 12:
            want.append(0.0)
        elif n <= 16:
            want.append((12 - n) / 4)
        else:
            want.append(-1.0)
    assert got == pytest.approx(want)


def test_dynamic_sampling_drops_groups_with_identical_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    assert groups_with_signal(rewards, 4).tolist() == [True, False, False]
