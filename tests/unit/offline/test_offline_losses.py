"""The offline losses (offline/losses.py) against their papers' definitions, one pair or
token at a time, and their gradients against derivations by hand:

  DPO (Rafailov et al. 2023, eq. 7), with cDPO's label smoothing eps:
      L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h),
      dL/dh = -beta ((1 - eps) sigma(-beta h) - eps sigma(beta h))
  IPO (Azar et al. 2023, eq. 17):  L = (h - 1 / (2 tau))^2,  dL/dh = 2 (h - 1 / (2 tau))
  with h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)): dh/dlog pi(y_c) = 1, dh/dlog pi(y_r) = -1
  Bradley-Terry (Ouyang et al. 2022, eq. 1): L = -log sigma(r_c - r_r), smoothed as DPO
  SFT: -sum_t m_t log pi(y_t), d/dlog pi(y_t) = -m_t
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer.offline.losses import bradley_terry_loss, dpo_loss, sft_loss_sum

BETA = 0.3


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def pairs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(-torch.rand(6, generator=gen, dtype=torch.float64) * 10).requires_grad_() for _ in range(4)]


def preference(loss_type: str, eps: float, h: float) -> tuple[float, float]:
    """(loss, dloss/dh) of one pair."""
    if loss_type == "ipo":
        return (h - 1 / (2 * BETA)) ** 2, 2 * (h - 1 / (2 * BETA))
    loss = -(1 - eps) * math.log(sigmoid(BETA * h)) - eps * math.log(sigmoid(-BETA * h))
    return loss, -BETA * ((1 - eps) * sigmoid(-BETA * h) - eps * sigmoid(BETA * h))


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_and_ipo_and_their_gradients_match_the_papers_pair_by_pair(loss_type, eps):
    pc, pr, rc, rr = pairs(0)
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=BETA, loss_type=loss_type, label_smoothing=eps)
    loss.sum().backward()
    for i in range(6):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        want, dh = preference(loss_type, eps, h)
        assert loss[i].item() == pytest.approx(want, rel=1e-9)
        assert pc.grad[i].item() == pytest.approx(dh, rel=1e-9)
        assert pr.grad[i].item() == pytest.approx(-dh, rel=1e-9)
        assert rc.grad[i].item() == pytest.approx(-dh, rel=1e-9)  # the reference is a constant to the caller
        assert chosen[i].item() == pytest.approx(BETA * (pc[i] - rc[i]).item())
        assert rejected[i].item() == pytest.approx(BETA * (pr[i] - rr[i]).item())
    assert not chosen.requires_grad and not rejected.requires_grad


def test_dpo_at_the_reference_is_log_two():
    """At pi = pi_ref, h = 0: the DPO loss is log 2 for any beta; IPO's is 1 / (4 tau^2)."""
    z = torch.zeros(3, dtype=torch.float64)
    assert dpo_loss(z, z, z, z, beta=BETA)[0].tolist() == pytest.approx([math.log(2)] * 3)
    assert dpo_loss(z, z, z, z, beta=BETA, loss_type="ipo")[0].tolist() == pytest.approx([1 / (4 * BETA ** 2)] * 3)


def test_unknown_preference_loss_names_the_field():
    z = torch.zeros(1)
    with pytest.raises(ValueError, match="preference.lossType"):
        dpo_loss(z, z, z, z, beta=0.1, loss_type="hinge")


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_bradley_terry_and_its_gradient_match_the_definition(eps):
    c = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64, requires_grad=True)
    got = bradley_terry_loss(c, r, eps)
    got.sum().backward()
    for i in range(3):
        d = c[i].item() - r[i].item()
        assert got[i].item() == pytest.approx(-(1 - eps) * math.log(sigmoid(d)) - eps * math.log(sigmoid(-d)))
        dd = -((1 - eps) * sigmoid(-d) - eps * sigmoid(d))
        assert c.grad[i].item() == pytest.approx(dd)
        assert r.grad[i].item() == pytest.approx(-dd)


def test_sft_loss_sums_the_trained_tokens_negative_log_likelihood():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    loss = sft_loss_sum(logp, mask)
    loss.backward()
    assert loss.item() == pytest.approx(4.0)
    assert logp.grad.tolist() == [[-1.0, 0.0, -1.0]]
