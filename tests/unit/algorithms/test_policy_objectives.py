"""GSPO and CISPO against their papers' equations, written here from the papers (products
of probability ratios, the sequence-level objective with its own autograd), not from the
trainer's helpers; the trainer's `compose_loss` must give the same loss and gradient."""

from __future__ import annotations

import torch

from rlhf_contract.api.models import AlgorithmSpec
from rlhf_contract.api.presets import PRESETS
from rlhf_trainer.algorithms.losses import agg_weights, compose_loss, sequence_means

from algorithm_cases import random_mask

B, T = 6, 5


def spec(preset: str, **fields) -> AlgorithmSpec:
    return AlgorithmSpec(**{**PRESETS[preset], "preset": preset, **fields})


def tables(seed: int, spread: float):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, gen)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    logp = old + (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * spread
    adv = torch.randn(B, 1, generator=gen, dtype=torch.float64).expand(B, T) * mask  # one per sequence
    return mask, old, logp, adv


def gspo_objective_from_the_paper(logp, old, adv, mask, eps_low, eps_high):
    """GSPO eq. (5)-(7): s_i = (prod_t pi / pi_old)^(1 / |y_i|);
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), over non-empty sequences
    (the trainer counts every row of the mini-batch in G, empty ones too)."""
    total = 0.0
    for i in range(B):
        n = int(mask[i].sum())
        if n == 0:
            continue
        probs, old_probs = logp[i, :n].exp(), old[i, :n].exp()
        s = torch.prod(probs / old_probs) ** (1.0 / n)
        a = adv[i, 0]
        total = total + torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
    return total / B


def test_gspo_loss_and_gradient_are_the_papers_sequence_objective():
    mask, old, logp, adv = tables(seed=1, spread=0.02)  # sequence log-ratios around +-3e-3: some clipped
    a = spec("gspo")
    assert (a.clip_low, a.clip_high) == (3e-4, 4e-4)  # the preset's clip range is the paper's
    mine = logp.clone().requires_grad_(True)
    # the trainer's packed layout: the rows one after another in one [1, B*T] row
    segments = [range(i * T, (i + 1) * T) for i in range(B)]
    seq = sequence_means((mine.detach() - old).reshape(1, -1), mask.reshape(1, -1), segments).reshape(B, T)
    loss, terms = compose_loss(a, logp=mine, entropy=torch.zeros_like(mine), old=old, advantages=adv,
                               coef=agg_weights(mask, a.loss_agg), seq_log_ratio=seq)
    loss.backward()
    theirs = logp.clone().requires_grad_(True)
    objective = gspo_objective_from_the_paper(theirs, old, adv, mask, a.clip_low, a.clip_high)
    (-objective).backward()
    assert torch.allclose(loss, -objective, atol=1e-12)
    assert torch.allclose(mine.grad * mask, theirs.grad * mask, atol=1e-12)
    clipped_rows = terms.clip_active.any(-1)
    assert clipped_rows.any() and not clipped_rows[mask.sum(-1) > 0].all()  # both kinds present
    # a clipped sequence contributes no gradient at all, every token of it (sequence-level clipping)
    assert (mine.grad[clipped_rows] == 0).all()


def test_gspo_ratio_is_length_normalised_not_the_token_product():
    """A sequence whose every token moved by the same factor has s = that factor, whatever its length."""
    logp = torch.full((1, 4), -1.0, dtype=torch.float64)
    old = logp - 0.1
    seq = sequence_means(logp - old, torch.ones(1, 4), [range(0, 4)])
    assert torch.allclose(seq.exp(), torch.full((1, 4), 0.1, dtype=torch.float64).exp())


def cispo_objective_from_the_paper(logp, old, adv, mask, eps_low, eps_high):
    """MiniMax-M1 eq. (4)-(5): J = 1 / sum_i |o_i| sum_i sum_t sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi."""
    r = torch.exp(logp.detach()) / torch.exp(old)
    w = torch.where(r > 1 + eps_high, torch.full_like(r, 1 + eps_high), r)
    w = torch.where(w < 1 - eps_low, torch.full_like(w, 1 - eps_low), w)
    return (w * adv * logp * mask).sum() / mask.sum()


def test_cispo_loss_and_gradient_are_the_papers():
    mask, old, logp, adv = tables(seed=6, spread=1.5)  # ratios from e^-0.75 to e^0.75
    a = spec("cispo", clip_high=0.3)  # a low cap, so that some weights are clipped here
    mine = logp.clone().requires_grad_(True)
    loss, terms = compose_loss(a, logp=mine, entropy=torch.zeros_like(mine), old=old, advantages=adv,
                               coef=agg_weights(mask, a.loss_agg))
    loss.backward()
    theirs = logp.clone().requires_grad_(True)
    objective = cispo_objective_from_the_paper(theirs, old, adv, mask, a.clip_low, a.clip_high)
    (-objective).backward()
    assert torch.allclose(loss, -objective, atol=1e-12)
    assert torch.allclose(mine.grad, theirs.grad * mask, atol=1e-12)
    # the clipped tokens keep their gradient (weight 1 + eps_high), where PPO's clip drops it
    clipped = terms.clip_active.bool() & (mask > 0) & (adv != 0)
    assert clipped.any() and (mine.grad[clipped] != 0).all()
    ppo = logp.clone().requires_grad_(True)
    ppo_loss, _ = compose_loss(spec("grpo", clip_low=a.clip_high, clip_high=a.clip_high, loss_agg="token-mean"),
                               logp=ppo, entropy=torch.zeros_like(ppo), old=old, advantages=adv,
                               coef=agg_weights(mask, "token-mean"))
    ppo_loss.backward()
    dropped_by_ppo = clipped & (torch.exp(logp - old) > 1 + a.clip_high) & (adv > 0)
    assert dropped_by_ppo.any() and (ppo.grad[dropped_by_ppo] == 0).all()


def test_on_policy_gspo_and_cispo_give_the_policy_gradient():
    """At ratio 1 (one mini-batch, old = current) both are REINFORCE with the advantage:
    the gradient of the loss with respect to logp is -A x coef."""
    mask, _, logp, adv = tables(seed=3, spread=0.0)
    for a in (spec("gspo"), spec("cispo")):
        x = logp.clone().requires_grad_(True)
        coef = agg_weights(mask, a.loss_agg)
        loss, _ = compose_loss(a, logp=x, entropy=torch.zeros_like(x), old=x.detach(), advantages=adv, coef=coef,
                               seq_log_ratio=torch.zeros_like(x))
        loss.backward()
        assert torch.allclose(x.grad, -adv * coef, atol=1e-12), a.policy_loss
