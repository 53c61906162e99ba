"""The cross-field rules are written once (api/rules.py): the trainer's preflight and its
parallel layout refuse with the contract's rule, on the world size it really runs."""

from __future__ import annotations

import copy

import pytest

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.api.rules import RULES, TP_WITH_CRITIC, TP_WITH_REWARD_MODEL
from rlhf_contract.trainer_config import TrainerConfig

JOB = {
    "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j"},
    "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
             "trainer": {"nprocPerNode": 4, "parallelism": {"tensorParallel": 2}}},
}


def config(**spec) -> TrainerConfig:
    data = copy.deepcopy(JOB)
    data["spec"].update(spec)
    return TrainerConfig.from_job(validate_job(data))


def test_a_valid_job_breaks_no_rule_on_its_own_world():
    assert config().rule_problems(4) == []


def test_the_trainer_checks_the_rules_on_the_world_it_runs():
    """The job said 4 processes; a trainer started with 3 is refused with the contract's rule."""
    (problem,) = config().rule_problems(3)
    rule = next(r for r in RULES if r.field_path == "trainer.parallelism")
    assert problem == rule.problem("2 x 1 does not divide 3")


def test_a_hand_built_config_is_held_to_every_rule():
    base = config()
    broken = base.model_copy(update={"algorithm": base.algorithm.model_copy(update={"critic": True,
                                                                                      "advantage_estimator": "gae"})})
    assert broken.rule_problems(4) == [TP_WITH_CRITIC.problem("got 2")]
    offline = broken.model_copy(update={"method": "sft"})
    assert offline.rule_problems(4) == []  # the critic is RL's


def test_parallel_layout_refuses_with_the_contracts_rule():
    parallelize = pytest.importorskip("rlhf_trainer.parallel.parallelize")
    kwargs = dict(ref=None, world_size=2, tp=2, cp=1, activation_checkpointing=False, device_type="cpu")
    with pytest.raises(ValueError) as info:
        parallelize.parallelize_models(None, critic=object(), **kwargs)
    assert str(info.value) == TP_WITH_CRITIC.problem("got 2")
    with pytest.raises(ValueError) as info:
        parallelize.parallelize_models(None, critic=None, reward_model=object(), **kwargs)
    assert str(info.value) == TP_WITH_REWARD_MODEL.problem("got 2")


def problems(algorithm: dict) -> list[str]:
    data = copy.deepcopy(JOB)
    data["spec"]["algorithm"] = algorithm
    data["spec"]["trainer"] = {}
    with pytest.raises(JobError) as info:
        validate_job(data)
    return str(info.value).splitlines()[1:]


@pytest.mark.parametrize(("correction", "field", "words"), [
    ({"mode": "token-mask", "upper": 2.0, "lower": 3.0}, "lower", "must not exceed algorithm.rolloutCorrection.upper"),
    ({"mode": "token-mask"}, "upper", "is required with mode token-mask"),
    ({"mode": "sequence-mask"}, "upper", "is required with mode token-mask, sequence-mask"),
    ({"mode": "two-sided-mask", "upper": 5.0}, "lower", "is required with mode two-sided-mask"),
    ({"mode": "tis", "lower": 0.5}, "lower", "is not used by mode tis"),
    ({"mode": "token-mask", "upper": 0.9}, "upper", "must be at least 1 with a mask mode"),
    ({"mode": "two-sided-mask", "upper": 5.0, "lower": -0.5}, "lower", "greater than 0"),
    ({"mode": "tis", "upper": -2.0}, "upper", "greater than 0"),
    ({"mode": "masked"}, "mode", "tis"),
])
def test_a_bad_rollout_correction_is_refused_naming_its_field(correction, field, words):
    found = problems({"rolloutCorrection": correction})
    assert any(p.strip().startswith(f"spec.algorithm.rolloutCorrection.{field}:") and words in p for p in found), found


def test_tis_cap_is_an_alias_of_tis_and_not_both():
    (problem,) = problems({"tisCap": 2.0, "rolloutCorrection": {"mode": "tis"}})
    assert problem.strip().startswith("spec.algorithm.tisCap:") and "keep only rolloutCorrection" in problem
    data = copy.deepcopy(JOB)
    data["spec"]["algorithm"], data["spec"]["trainer"] = {"tisCap": 1.5}, {}
    assert validate_job(data).spec.algorithm.correction().model_dump() == {"mode": "tis", "upper": 1.5, "lower": None}
