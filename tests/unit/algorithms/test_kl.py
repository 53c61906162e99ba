"""Schulman's KL estimators (algorithms/kl.py) against "Approximating KL Divergence"
(Schulman 2020), token by token: with x sampled from the policy pi and
rho = pi_ref(x) / pi(x), k1 = -log rho, k2 = (log rho)^2 / 2, k3 = (rho - 1) - log rho."""

import math

import pytest
import torch

from rlhf_trainer.algorithms.kl import kl_penalty


def schulman(estimator: str, logp: float, ref: float) -> float:
    rho = math.exp(ref - logp)
    return {"k1": -math.log(rho), "k2": 0.5 * math.log(rho) ** 2, "k3": (rho - 1) - math.log(rho)}[estimator]


def schulman_grad(estimator: str, logp: float, ref: float) -> float:
    """d k / d logp, by hand: d rho / d logp = -rho."""
    rho = math.exp(ref - logp)
    return {"k1": 1.0, "k2": logp - ref, "k3": 1.0 - rho}[estimator]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_and_its_gradient_match_the_definitions(seed, estimator):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    out = kl_penalty(logp, ref, estimator)
    out.sum().backward()
    for i in range(4):
        for j in range(6):
            lp, r = logp[i, j].item(), ref[i, j].item()
            assert out[i, j].item() == pytest.approx(schulman(estimator, lp, r), abs=1e-12)
            assert logp.grad[i, j].item() == pytest.approx(schulman_grad(estimator, lp, r), abs=1e-12)
    if estimator != "k1":
        assert (out >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_the_kl():
    """Sampled from pi, the mean of k1 and of k3 is KL(pi || pi_ref) (k2 is biased)."""
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pi_ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = float((pi * (pi / pi_ref).log()).sum())
    for estimator in ("k1", "k3"):  # the expectation, exactly: sum over x of pi(x) k(x)
        assert float((pi * kl_penalty(pi.log(), pi_ref.log(), estimator)).sum()) == pytest.approx(kl, abs=1e-12)
    assert float((pi * kl_penalty(pi.log(), pi_ref.log(), "k2")).sum()) != pytest.approx(kl, abs=1e-3)


def test_unknown_estimator_names_the_field():
    with pytest.raises(ValueError, match="algorithm.klEstimator"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
