"""The rollout correction (algorithms/corrections.py) against its definitions, on tables
small enough to work out by hand. Token ratios are set exactly: rollout log-probs 0 and old
log-probs log(rho), so rho = pi_old / pi_rollout is the number written below.

  tis             w = min(rho, U)                                   (Yao et al. 2025)
  token-mask      w = rho if L <= rho <= U else 0                   (masked IS, Liu, Li et al. 2025)
  sequence-mask   rho_i = (prod over the row's tokens of rho)^(1/n)  (GSPO's s_i), the row's
                  tokens all get rho_i if L <= rho_i <= U, else 0
  two-sided-mask  token-mask with both bounds                       (IcePop, Ling Team 2025)
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_contract.api.models import AlgorithmSpec, RolloutCorrectionSpec
from rlhf_contract.api.presets import PRESETS
from rlhf_trainer.algorithms.corrections import correction_metrics, importance_ratios, rollout_correction
from rlhf_trainer.algorithms.losses import agg_weights, compose_loss

# rows of token ratios; None is padding (off the response mask: its ratio, 9, must not count)
RATIOS = [[3.0, 0.25, 1.0, 1.5],
          [0.5, 2.0, None, None],
          [4.0, 4.0, None, None],
          [0.5, 0.5, 0.5, None]]


def tables() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.tensor([[math.log(r if r is not None else 9.0) for r in row] for row in RATIOS], dtype=torch.float64)
    mask = torch.tensor([[float(r is not None) for r in row] for row in RATIOS], dtype=torch.float64)
    return old, torch.zeros_like(old), mask


def expected(keep, weight) -> tuple[list[list[float]], list[list[bool]]]:
    """(weights, masked) from a token's rule: keep(i, j, rho) says whether it stays, weight(i, j,
    rho) what it gets then; padding: weight 0, not masked."""
    w = [[(weight(i, j, r) if keep(i, j, r) else 0.0) if r is not None else 0.0 for j, r in enumerate(row)]
         for i, row in enumerate(RATIOS)]
    masked = [[r is not None and not keep(i, j, r) for j, r in enumerate(row)] for i, row in enumerate(RATIOS)]
    return w, masked


def geometric_mean(i: int) -> float:
    valid = [r for r in RATIOS[i] if r is not None]
    return math.prod(valid) ** (1 / len(valid))


def check(spec: RolloutCorrectionSpec, want_w, want_masked):
    old, rollout, mask = tables()
    c = rollout_correction(spec, old, rollout, mask)
    assert c.weights.tolist() == [pytest.approx(row, rel=1e-12) for row in want_w]
    assert c.masked.tolist() == want_masked
    return c


def test_tis_truncates_each_token_ratio_at_upper_and_masks_nothing():
    want = expected(lambda i, j, r: True, lambda i, j, r: min(r, 2.0))
    c = check(RolloutCorrectionSpec(mode="tis", upper=2.0), *want)
    assert want[0][0] == [2.0, 0.25, 1.0, 1.5]  # the hand-worked first row
    assert correction_metrics(c, tables()[2])["rollout_correction_masked_fraction"] == 0.0


def test_token_mask_zeroes_tokens_above_upper_and_keeps_the_ratio_of_the_others():
    want = expected(lambda i, j, r: r <= 2.0, lambda i, j, r: r)
    check(RolloutCorrectionSpec(mode="token-mask", upper=2.0), *want)
    # by hand: 3 and both 4s are over 2; 2.0 itself sits on the bound and stays
    assert want[0] == [[0.0, 0.25, 1.0, 1.5], [0.5, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.0]]


def test_token_mask_with_a_lower_bound_masks_both_sides():
    want = expected(lambda i, j, r: 0.6 <= r <= 2.0, lambda i, j, r: r)
    check(RolloutCorrectionSpec(mode="token-mask", upper=2.0, lower=0.6), *want)


def test_two_sided_mask_is_icepops_band():
    want = expected(lambda i, j, r: 0.5 <= r <= 2.0, lambda i, j, r: r)
    c = check(RolloutCorrectionSpec(mode="two-sided-mask", upper=2.0, lower=0.5), *want)
    # by hand: 3 (above), 0.25 (below), 4 and 4 (above) are masked: 4 of 11 response tokens
    assert sum(map(sum, want[1])) == 4
    metrics = correction_metrics(c, tables()[2])
    assert metrics["rollout_correction_masked_fraction"] == pytest.approx(4 / 11)
    kept = [w for row, m in zip(*want) for w, x in zip(row, m) if not x and w]
    assert metrics["rollout_correction_weight_mean"] == pytest.approx(sum(kept) / len(kept))


def test_sequence_mask_uses_the_geometric_mean_of_the_rows_valid_tokens():
    want = expected(lambda i, j, r: 0.6 <= geometric_mean(i) <= 2.0, lambda i, j, r: geometric_mean(i))
    check(RolloutCorrectionSpec(mode="sequence-mask", upper=2.0, lower=0.6), *want)
    # by hand: row 0 (3 x 0.25 x 1 x 1.5)^(1/4) = 1.125^(1/4) kept; row 1 (0.5 x 2)^(1/2) = 1 kept
    # (with the padding's 9 it would be 9^(1/3) > 2: masked); row 2: 4 masked; row 3: 0.5 masked
    assert [geometric_mean(i) for i in range(4)] == pytest.approx([1.125 ** 0.25, 1.0, 4.0, 0.5])
    assert want[1] == [[False] * 4, [False] * 2 + [False] * 2, [True, True, False, False], [True, True, True, False]]


def test_sequence_ratios_are_length_normalised_so_one_threshold_fits_every_length():
    """A per-token drift of 1.01 over 1,000 tokens: the product would be e^9.95 (masked by any
    threshold near 1); the geometric mean is 1.01."""
    old = torch.full((1, 1000), math.log(1.01), dtype=torch.float64)
    rho = importance_ratios(old, torch.zeros_like(old), torch.ones_like(old), "sequence")
    assert rho[0, 0].item() == pytest.approx(1.01) and torch.equal(rho, rho[:, :1].expand_as(rho))


def test_the_weights_are_detached():
    old, rollout, mask = tables()
    old.requires_grad_()
    for mode in ("tis", "token-mask", "sequence-mask"):
        assert not rollout_correction(RolloutCorrectionSpec(mode=mode, upper=2.0), old, rollout, mask).weights.requires_grad


def test_masked_tokens_get_exactly_zero_gradient_from_every_term_of_the_loss():
    """The policy term, the entropy bonus and the KL term of a masked token: all gone; a kept
    token's gradient is its ratio times the unmasked one (the weight only scales)."""
    old, rollout, mask = tables()
    spec = RolloutCorrectionSpec(mode="two-sided-mask", upper=2.0, lower=0.5)
    a = AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.1, "entropy_coef": 0.01, "rollout_correction": spec})
    c = rollout_correction(spec, old, rollout, mask)
    gen = torch.Generator().manual_seed(0)
    advantages = torch.randn(old.shape, generator=gen, dtype=torch.float64) * mask
    ref = old - 0.3

    def grads(correction, algorithm):
        logp = (old + 0.05).clone().requires_grad_()
        entropy = torch.ones_like(old, requires_grad=True)
        loss, _ = compose_loss(algorithm, logp=logp, entropy=entropy, old=old, advantages=advantages,
                               coef=agg_weights(mask, "token-mean"), ref=ref, correction=correction)
        loss.backward()
        return logp.grad, entropy.grad

    dlogp, dentropy = grads(c.weights, a)
    assert c.masked.any()
    assert torch.all(dlogp[c.masked] == 0) and torch.all(dentropy[c.masked] == 0)
    kept = mask.bool() & ~c.masked
    assert torch.all(dentropy[kept] != 0) and torch.all(dlogp[kept] != 0)
    # without KL and entropy, a kept token's gradient is w x the uncorrected one
    plain = AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0})
    policy_only = plain.model_copy(update={"rollout_correction": spec})
    weighted, _ = grads(c.weights, policy_only)
    unweighted, _ = grads(None, plain)
    assert weighted[kept].tolist() == pytest.approx((c.weights * unweighted)[kept].tolist(), rel=1e-12)


def test_masked_tokens_still_count_in_the_aggregation():
    """token-mean over 11 response tokens: a kept token's gradient is 1/11 of -A w (r = 1),
    whatever was masked."""
    old, rollout, mask = tables()
    spec = RolloutCorrectionSpec(mode="token-mask", upper=2.0)
    a = AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0, "loss_agg": "token-mean", "rollout_correction": spec})
    c = rollout_correction(spec, old, rollout, mask)
    logp = old.clone().requires_grad_()
    advantages = torch.ones_like(old) * mask
    loss, _ = compose_loss(a, logp=logp, entropy=torch.zeros_like(old), old=old, advantages=advantages,
                           coef=agg_weights(mask, "token-mean"), correction=c.weights)
    loss.backward()
    assert logp.grad.tolist() == [pytest.approx([-w / 11 for w in row], rel=1e-12) for row in c.weights.tolist()]


def test_a_spec_without_its_threshold_is_refused_by_name():
    old, rollout, mask = tables()
    with pytest.raises(ValueError, match="algorithm.rolloutCorrection.upper"):
        rollout_correction(RolloutCorrectionSpec.model_construct(mode="token-mask", upper=None, lower=None),
                           old, rollout, mask)
    with pytest.raises(ValueError, match="algorithm.rolloutCorrection.lower"):
        rollout_correction(RolloutCorrectionSpec(mode="two-sided-mask", upper=2.0), old, rollout, mask)
