"""Each vectorised algorithm function against a plain loop written from the equation."""

import math
import random

import pytest
import torch

from rlhf_trainer.algorithms.advantages import compute_advantages
from rlhf_trainer.algorithms.kl import kl_penalty
from rlhf_trainer.algorithms.losses import AGGREGATIONS, agg_loss, policy_loss


def random_mask(b, t, gen):
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = 1  # a single-token response
    lengths[-1] = 0  # an all-masked row
    return (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_loop(seed, estimator):
    gen = torch.Generator().manual_seed(seed)
    logp, ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3, -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    out = kl_penalty(logp, ref, estimator)
    for i in range(4):
        for j in range(6):
            d = logp[i, j].item() - ref[i, j].item()
            want = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator]
            assert out[i, j].item() == pytest.approx(want, abs=1e-12)
    if estimator == "k3":
        assert (out >= 0).all()


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


def loop_agg(loss, mask, agg):
    rows = []
    total, count = 0.0, 0.0
    for i in range(loss.shape[0]):
        s = sum(loss[i, j].item() * mask[i, j].item() for j in range(loss.shape[1]))
        n = sum(mask[i, j].item() for j in range(loss.shape[1]))
        total, count = total + s, count + n
        rows.append({"seq-mean-token-mean": s / n if n else 0.0, "seq-mean-token-sum": s,
                     "seq-mean-token-sum-norm": s / loss.shape[1]}.get(agg))
    if agg == "token-mean":
        return total / count
    return sum(rows) / len(rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_loop(seed, agg, dual_clip):
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 7
    mask = random_mask(b, t, gen)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64)
    old = logp + (torch.rand(b, t, generator=gen, dtype=torch.float64) - 0.5) * 1.5
    adv = (torch.randn(b, t, generator=gen, dtype=torch.float64) * 2) * mask
    clip_low, clip_high = 0.2, 0.28
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, agg=agg)
    per_token = torch.zeros(b, t, dtype=torch.float64)
    clipped = 0
    for i in range(b):
        for j in range(t):
            ratio = math.exp(logp[i, j].item() - old[i, j].item())
            a = adv[i, j].item()
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            l = max(l1, l2)
            if dual_clip is not None and a < 0:
                l = min(l, -a * dual_clip)
            per_token[i, j] = l
            clipped += int(l2 > l1) * int(mask[i, j].item())
    assert loss.item() == pytest.approx(loop_agg(per_token, mask, agg), abs=1e-10)
    assert metrics["clip_fraction"].item() == pytest.approx(clipped / mask.sum().item())


def test_micro_batches_sum_to_the_whole_batch_loss():
    """With the step's global counts, micro-batch losses add up to the full-batch loss."""
    gen = torch.Generator().manual_seed(3)
    b, t = 8, 5
    mask = random_mask(b, t, gen)
    loss = torch.rand(b, t, generator=gen, dtype=torch.float64)
    for agg in AGGREGATIONS:
        whole = agg_loss(loss, mask, agg)
        parts = sum(agg_loss(loss[i:i + 3], mask[i:i + 3], agg, num_tokens=mask.sum().item(), num_seqs=b) for i in range(0, b, 3))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-12), agg


def test_gradient_of_ratio_one_is_advantage_weighted_logprob():
    """At ratio 1 (on-policy), the PPO loss gradient equals that of -A * logp (token-mean)."""
    logp = torch.tensor([[-0.5, -1.0], [-2.0, -0.1]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert torch.allclose(logp.grad, -adv * mask / 3)


# ---- GAE, REINFORCE++, whitening, value loss, DAPO pieces, TIS ------------------------

from rlhf_trainer.algorithms.advantages import discounted_returns, gae, groups_with_signal, masked_whiten, overlong_penalty
from rlhf_trainer.algorithms.losses import explained_variance, truncated_is_weights, value_loss


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


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clip", [None, 0.1])
def test_value_loss_matches_loop(seed, clip):
    mask, returns, values = random_batch(seed)
    old = values + 0.3 * torch.randn(values.shape, generator=torch.Generator().manual_seed(seed + 9), dtype=torch.float64)
    loss, _ = value_loss(values, old, returns, mask, clip=clip)
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            l = (v - r) ** 2
            if clip is not None:
                vc = o + min(max(v - o, -clip), clip)
                l = max(l, (vc - r) ** 2)
            total, count = total + 0.5 * l, count + 1
    assert loss.item() == pytest.approx(total / count, abs=1e-10)


def test_truncated_importance_weights_are_capped_ratios():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5]])
    w = truncated_is_weights(old, rollout, cap=1.5)
    assert w.tolist()[0] == pytest.approx([min(math.exp(0.5), 1.5), math.exp(-1.0), 1.0])
    # the weights scale the per-token loss
    adv, mask = torch.ones(1, 3), torch.ones(1, 3)
    plain, _ = policy_loss(old, old, adv, mask)
    weighted, _ = policy_loss(old, old, adv, mask, is_weights=w)
    assert weighted.item() == pytest.approx(plain.item() * w.mean().item())


def test_explained_variance():
    mask = torch.ones(1, 4)
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert explained_variance(r, r, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, mask).item() == pytest.approx(0.0)


def _loop_reduction(loss: list[list[float]], mask: list[list[float]], agg: str) -> float:
    """DESIGN.md's definitions, with plain Python loops."""
    rows = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss, mask)]
    width = len(mask[0])
    if agg == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if agg == "seq-mean-token-mean":
        return sum(s / n for s, n in rows) / len(rows)
    if agg == "seq-mean-token-sum":
        return sum(s for s, _ in rows) / len(rows)
    return sum(s / width for s, _ in rows) / len(rows)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_agg_weights_match_the_loop_definitions(agg):
    """The trainer weights each packed token by agg_weights (train/step.py): the weighted
    sum must be the aggregation as DESIGN.md defines it."""
    from rlhf_trainer.algorithms.losses import agg_weights

    gen = torch.Generator().manual_seed(5)
    mask = random_mask(6, 7, gen)
    mask[:, 0] = 1  # every row has a token (seq-mean-token-mean divides by it)
    loss = torch.rand(6, 7, generator=gen, dtype=torch.float64)
    want = _loop_reduction(loss.tolist(), mask.tolist(), agg)
    assert (loss * agg_weights(mask, agg).double()).sum().item() == pytest.approx(want, rel=1e-6)
