"""The loss the trainer runs (algorithms/losses.py: compose_loss and its parts) against
plain loops written from the papers, in the papers' own form (an objective to maximise;
the loss is its negative):

  PPO clip (Schulman et al. 2017, eq. 7):  J = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
  dual clip (Ye et al. 2020), where A < 0:  J = max(J, c A)
  TIS (Yao et al. 2025):  J * min(pi_old / pi_rollout, C) (the masks: test_corrections.py)
  entropy bonus (Schulman et al. 2017, eq. 9):  + c_H H
  KL in the loss (Shao et al. 2024):  - beta k(pi || pi_ref)
  aggregations: token mean; mean over sequences of the token mean / sum; Dr. GRPO's
  (Liu et al. 2025) mean over sequences of the token sum / W.
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithm_cases import random_mask
from rlhf_contract.api.models import AlgorithmSpec, RolloutCorrectionSpec
from rlhf_contract.api.presets import PRESETS
from rlhf_trainer.algorithms.losses import (AGGREGATIONS, agg_weights, compose_loss, explained_variance,
                                            ppo_token_loss, value_token_loss)
from rlhf_trainer.algorithms.corrections import rollout_correction


# ---- references, one token (or one row) at a time ---------------------------------------

def ppo_objective(logp: float, old: float, adv: float, eps_low: float, eps_high: float,
                  dual: float | None) -> tuple[float, bool, float]:
    """(J, whether the ratio clip is the min, dJ/dlogp by hand)."""
    r = math.exp(logp - old)
    clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
    j, clip_wins = min(r * adv, clipped_r * adv), clipped_r * adv < r * adv
    grad = 0.0 if clip_wins else r * adv  # d(r A)/dlogp = r A; a clipped ratio is a constant
    if dual is not None and adv < 0 and dual * adv > j:
        j, grad = dual * adv, 0.0
    return j, clip_wins, grad


def kl_estimate(estimator: str, logp: float, ref: float) -> tuple[float, float]:
    """Schulman's k1, k2, k3 with rho = pi_ref / pi, and d k / d logp."""
    rho = math.exp(ref - logp)
    return {"k1": (-math.log(rho), 1.0), "k2": (0.5 * math.log(rho) ** 2, logp - ref),
            "k3": ((rho - 1) - math.log(rho), 1.0 - rho)}[estimator]


def aggregate(rows: list[list[float]], agg: str, width: int) -> float:
    """A mini-batch's loss from each row's valid-token losses (empty rows count as rows)."""
    sums, counts = [sum(r) for r in rows], [len(r) for r in rows]
    if agg == "token-mean":
        return sum(sums) / sum(counts)
    per_row = {"seq-mean-token-mean": [s / n if n else 0.0 for s, n in zip(sums, counts)],
               "seq-mean-token-sum": sums,
               "seq-mean-token-sum-norm": [s / width for s in sums]}[agg]
    return sum(per_row) / len(rows)


def spec(**fields) -> AlgorithmSpec:
    return AlgorithmSpec(**{**PRESETS["grpo"], "kl_coef": 0.0, **fields})


def batch(seed: int, b: int = 6, t: int = 7) -> dict[str, torch.Tensor]:
    """A mini-batch's [B, T] tables; logp is off-policy enough that every clip binds somewhere."""
    gen = torch.Generator().manual_seed(seed)

    def rand(scale: float = 1.0) -> torch.Tensor:
        return torch.rand(b, t, generator=gen, dtype=torch.float64) * scale

    mask = random_mask(b, t, gen)
    mask[1, :t - 1] = 1  # a long row: the widest response is shorter than T
    old = -rand(3)
    logp = old + (rand() - 0.5) * 3
    return {"mask": mask, "logp": logp, "old": old, "advantages": torch.randn(b, t, generator=gen, dtype=torch.float64)
            * 2 * mask, "entropy": rand(2), "ref": old + (rand() - 0.5), "rollout": old + (rand() - 0.5)}


def reference_loss(a: AlgorithmSpec, tables: dict[str, torch.Tensor], width: int) -> tuple[float, list[list[float]]]:
    """The mini-batch loss written from the papers, and dL/dlogp per token by hand."""
    mask = tables["mask"]
    rows, grads = [], []
    for i in range(mask.shape[0]):
        row, grad_row = [], []
        for j in range(mask.shape[1]):
            lp, o, adv, h, ref, ro = (tables[k][i, j].item() for k in
                                      ("logp", "old", "advantages", "entropy", "ref", "rollout"))
            objective, _, grad = ppo_objective(lp, o, adv, a.clip_low, a.clip_high, a.dual_clip)
            weight = correction_weight(a, tables, i, j)
            kl, dkl = kl_estimate(a.kl_estimator, lp, ref)
            beta = a.kl_coef if a.kl_mode == "loss" else 0.0
            if mask[i, j] and weight == 0.0:  # masked out of the loss, still counted in its mean
                row.append(0.0)
            elif mask[i, j]:
                row.append(-weight * objective - a.entropy_coef * h + beta * kl)
            grad_row.append(-weight * grad + beta * dkl if mask[i, j] and weight else 0.0)
        rows.append(row)
        grads.append(grad_row)
    counts = [len(r) for r in rows]
    return aggregate(rows, a.loss_agg, width), [
        [g * token_weight(a.loss_agg, counts[i], sum(counts), len(rows), width) if counts[i] else 0.0 for g in gr]
        for i, gr in enumerate(grads)]


def correction_weight(a: AlgorithmSpec, tables: dict[str, torch.Tensor], i: int, j: int) -> float:
    """The rollout correction's weight of token (i, j) from its definition (test_corrections.py
    has the hand-worked cases): TIS min(rho, U); a mask keeps rho (the token's, or the
    geometric mean of its row's valid tokens for sequence-mask) inside [L, U], else 0."""
    spec = a.correction()
    if spec is None:
        return 1.0
    log_ratio = [(tables["old"][i, k] - tables["rollout"][i, k]).item() for k in range(tables["mask"].shape[1])
                 if tables["mask"][i, k]]
    rho = math.exp((tables["old"][i, j] - tables["rollout"][i, j]).item())
    if spec.mode == "tis":
        return min(rho, spec.upper)
    if spec.mode == "sequence-mask":
        rho = math.exp(sum(log_ratio) / len(log_ratio)) if log_ratio else 1.0  # an empty row: off the mask anyway
    return rho if (spec.lower or 0.0) <= rho <= spec.upper else 0.0


def token_weight(agg: str, row_tokens: int, tokens: int, seqs: int, width: int) -> float:
    """d aggregate / d (one valid token's loss), by hand from `aggregate`."""
    return {"token-mean": 1 / tokens, "seq-mean-token-mean": 1 / (row_tokens * seqs),
            "seq-mean-token-sum": 1 / seqs, "seq-mean-token-sum-norm": 1 / (width * seqs)}[agg]


CONFIGS = {
    "ppo": {},
    "dual-clip": {"dual_clip": 3.0, "clip_high": 0.28},
    "tis": {"tis_cap": 1.2},
    "tis-spec": {"rollout_correction": RolloutCorrectionSpec(mode="tis", upper=1.1)},
    "token-mask": {"rollout_correction": RolloutCorrectionSpec(mode="token-mask", upper=1.3), "entropy_coef": 0.01},
    "sequence-mask": {"rollout_correction": RolloutCorrectionSpec(mode="sequence-mask", upper=1.05, lower=0.95),
                      "kl_coef": 0.1},
    "two-sided-mask": {"rollout_correction": RolloutCorrectionSpec(mode="two-sided-mask", upper=1.3, lower=0.8),
                       "kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.01},
    "entropy": {"entropy_coef": 0.01},
    "kl-k1": {"kl_coef": 0.1, "kl_estimator": "k1"},
    "kl-k2": {"kl_coef": 0.1, "kl_estimator": "k2"},
    "kl-k3": {"kl_coef": 0.1, "kl_estimator": "k3", "dual_clip": 2.0, "tis_cap": 1.5, "entropy_coef": 0.02},
    "kl-in-reward": {"kl_coef": 0.1, "kl_estimator": "k3", "kl_mode": "reward"},
}


def weights(a: AlgorithmSpec, tables: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The correction's weights (its own tests: test_corrections.py)."""
    spec = a.correction()
    return None if spec is None else rollout_correction(spec, tables["old"], tables["rollout"], tables["mask"]).weights


def run_compose(a: AlgorithmSpec, tables: dict[str, torch.Tensor], width: int, rows=slice(None)):
    coef = agg_weights(tables["mask"], a.loss_agg, width=width)
    logp = tables["logp"][rows].clone().requires_grad_()
    w = weights(a, tables)
    loss, terms = compose_loss(a, logp=logp, entropy=tables["entropy"][rows], old=tables["old"][rows],
                               advantages=tables["advantages"][rows], coef=coef[rows], ref=tables["ref"][rows],
                               correction=None if w is None else w[rows])
    loss.backward()
    return loss, terms, logp.grad


# ---- compose_loss: the loss the trainer runs ----------------------------------------------

@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_compose_loss_and_its_gradient_match_the_papers(agg, config):
    tables = batch(seed=len(config) + len(agg))
    a = spec(loss_agg=agg, **CONFIGS[config])
    width = int(tables["mask"].sum(-1).max())
    loss, terms, grad = run_compose(a, tables, width)
    want, want_grad = reference_loss(a, tables, width)
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert grad.tolist() == [pytest.approx(row, abs=1e-12) for row in want_grad]
    want_kl = [[kl_estimate(a.kl_estimator, lp, r)[0] for lp, r in zip(lr, rr)]
               for lr, rr in zip(tables["logp"].tolist(), tables["ref"].tolist())]
    assert terms.kl.tolist() == [pytest.approx(row, abs=1e-12) for row in want_kl]


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batch_losses_split_any_way_sum_to_the_mini_batch_loss(agg):
    """The trainer packs a mini-batch's tokens into micro-batches (rows split over ranks
    and, under context parallelism, inside a row) and sums their losses and gradients."""
    tables = batch(seed=7, b=8, t=6)
    a = spec(loss_agg=agg, **CONFIGS["kl-k3"])
    width = int(tables["mask"].sum(-1).max())
    coef = agg_weights(tables["mask"], agg, width=width)
    valid = tables["mask"].flatten().nonzero().squeeze(-1)
    packed = {k: v.flatten()[valid].unsqueeze(0) for k, v in tables.items()}  # [1, n]: every valid token
    packed_coef = coef.flatten()[valid].unsqueeze(0)
    n = packed["mask"].shape[-1]
    whole, want_grad = reference_loss(a, tables, width)
    want_grad = torch.tensor(want_grad, dtype=torch.float64).flatten()[valid]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        order = torch.randperm(n, generator=gen)
        cuts = sorted(torch.randint(0, n + 1, (3,), generator=gen).tolist())
        total, grad = 0.0, torch.zeros(n, dtype=torch.float64)
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            part = order[lo:hi]
            logp = packed["logp"][:, part].clone().requires_grad_()
            loss, _ = compose_loss(a, logp=logp, entropy=packed["entropy"][:, part], old=packed["old"][:, part],
                                   advantages=packed["advantages"][:, part], coef=packed_coef[:, part],
                                   ref=packed["ref"][:, part], correction=weights(a, packed)[:, part])
            loss.backward()
            total, grad[part] = total + loss.item(), logp.grad[0]
        assert total == pytest.approx(whole, abs=1e-12)
        assert grad.tolist() == pytest.approx(want_grad.tolist(), abs=1e-12)


def test_on_policy_gradient_is_the_advantage_weighted_log_prob_gradient():
    """At r = 1 (the step's first pass) the PPO gradient is REINFORCE's: -A coef."""
    tables = batch(seed=3)
    tables["old"] = tables["logp"].clone()
    _, terms, grad = run_compose(spec(loss_agg="token-mean"), tables, width=7)
    mask = tables["mask"]
    assert torch.allclose(grad, -tables["advantages"] * mask / mask.sum(), atol=1e-15)
    assert not terms.clip_active.any()


def test_compose_loss_without_a_reference_has_no_kl():
    tables = batch(seed=4)
    coef = agg_weights(tables["mask"])
    loss, terms = compose_loss(spec(kl_coef=0.1, loss_agg="token-mean"), logp=tables["logp"], entropy=tables["entropy"],
                               old=tables["old"], advantages=tables["advantages"], coef=coef)
    assert terms.kl is None
    assert loss.item() == pytest.approx(reference_loss(spec(loss_agg="token-mean"), tables, 7)[0], abs=1e-12)


def test_compose_loss_with_a_correction_needs_its_weights():
    tables = batch(seed=5)
    with pytest.raises(ValueError, match="algorithm.rolloutCorrection"):
        compose_loss(spec(tis_cap=2.0), logp=tables["logp"], entropy=tables["entropy"], old=tables["old"],
                     advantages=tables["advantages"], coef=agg_weights(tables["mask"]))


# ---- the parts ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_token_loss_matches_the_clipped_objective(seed, dual_clip):
    tables = batch(seed)
    loss, clip_active = ppo_token_loss(tables["logp"], tables["old"], tables["advantages"], clip_low=0.2,
                                       clip_high=0.28, dual_clip=dual_clip)
    for i in range(loss.shape[0]):
        for j in range(loss.shape[1]):
            objective, clip_wins, _ = ppo_objective(tables["logp"][i, j].item(), tables["old"][i, j].item(),
                                                    tables["advantages"][i, j].item(), 0.2, 0.28, dual_clip)
            assert loss[i, j].item() == pytest.approx(-objective, abs=1e-12)
            assert bool(clip_active[i, j]) == clip_wins


@pytest.mark.parametrize("r, adv, want, active", [
    (1.5, 1.0, -1.28, True),    # A > 0, r above 1 + eps_high: the gain stops at the clip
    (0.5, 1.0, -0.5, False),    # A > 0, r below 1 - eps_low: not clipped (the min keeps r A)
    (0.5, -1.0, 0.8, True),     # A < 0, r below 1 - eps_low: clipped
    (2.0, -1.0, 2.0, False),    # A < 0, r large: not clipped ...
    (4.0, -1.0, 3.0, False),    # ... until the dual clip c = 3 bounds the loss at -c A
])
def test_ppo_token_loss_cases(r, adv, want, active):
    logp, old, adv = (torch.tensor([x], dtype=torch.float64) for x in (math.log(r), 0.0, adv))
    loss, clip_active = ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(want)
    assert bool(clip_active) == active


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_agg_weights_give_the_aggregations(agg):
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(6, 7, gen)
    loss = torch.rand(6, 7, generator=gen, dtype=torch.float64)
    rows = [[loss[i, j].item() for j in range(7) if mask[i, j]] for i in range(6)]
    for width in (None, 5):  # None: W = T
        got = (loss * agg_weights(mask, agg, width=width)).sum().item()
        assert got == pytest.approx(aggregate(rows, agg, width or 7), abs=1e-12)
    # explicit totals equal to the mask's own change nothing
    explicit = agg_weights(mask, agg, num_tokens=float(mask.sum()), num_seqs=6)
    assert torch.equal(explicit, agg_weights(mask, agg))


def test_agg_weights_of_an_empty_mini_batch_are_zero_and_an_unknown_agg_names_the_field():
    for agg in AGGREGATIONS:
        assert agg_weights(torch.zeros(2, 3), agg).abs().max() == 0
    with pytest.raises(ValueError, match="algorithm.lossAgg"):
        agg_weights(torch.ones(1, 1), "sum")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("clip", [None, 0.1])
def test_value_token_loss_matches_loop(seed, clip):
    gen = torch.Generator().manual_seed(seed)
    values, returns, old = (torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    loss, clipped = value_token_loss(values, old, returns, clip)
    for i in range(4):
        for j in range(5):
            v, o, r = values[i, j].item(), old[i, j].item(), returns[i, j].item()
            plain = (v - r) ** 2
            with_clip = (o + min(max(v - o, -clip), clip) - r) ** 2 if clip is not None else plain
            assert loss[i, j].item() == pytest.approx(0.5 * max(plain, with_clip), abs=1e-12)
            assert bool(clipped[i, j]) == (with_clip > plain)


def test_explained_variance_matches_loop():
    gen = torch.Generator().manual_seed(2)
    mask = random_mask(5, 4, gen)
    values, returns = (torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    pairs = [(values[i, j].item(), returns[i, j].item()) for i in range(5) for j in range(4) if mask[i, j]]

    def var(xs):
        return sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)

    want = 1 - var([r - v for v, r in pairs]) / var([r for _, r in pairs])
    assert explained_variance(values, returns, mask).item() == pytest.approx(want, abs=1e-12)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(values, torch.ones_like(returns), mask).item() == 0.0  # returns that do not vary
