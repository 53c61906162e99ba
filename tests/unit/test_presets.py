"""Algorithm presets: defaults any field overrides; the table in docs/reference.md is the real one."""

import copy
from pathlib import Path

import pytest

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.api.presets import PRESETS, preset_table

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "p"},
    "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
             "rollout": {"maxTokens": 100}},
}


def job(**algorithm):
    data = copy.deepcopy(BASE)
    data["spec"]["algorithm"] = algorithm
    return validate_job(data)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_resolves_to_its_table(preset):
    algo = job(preset=preset).spec.algorithm
    for field, value in PRESETS[preset].items():
        want = 100 // 5 if value == "maxTokens/5" else value
        assert getattr(algo, field) == want, field


def test_a_single_field_overrides_the_preset():
    algo = job(preset="dapo", clipHigh=0.35, dynamicSampling=False).spec.algorithm
    assert (algo.clip_high, algo.dynamic_sampling) == (0.35, False)
    assert (algo.clip_low, algo.loss_agg, algo.overlong_buffer) == (0.2, "token-mean", 20)
    # no algorithm section at all: grpo
    data = copy.deepcopy(BASE)
    assert validate_job(data).spec.algorithm.kl_coef == PRESETS["grpo"]["kl_coef"]


def test_resolved_config_round_trips():
    resolved = job(preset="ppo").to_config()
    assert resolved["spec"]["algorithm"]["advantageEstimator"] == "gae"
    again = validate_job(copy.deepcopy(resolved))
    assert again.to_config() == resolved


@pytest.mark.parametrize(("staleness", "algorithm", "want"), [
    (1, {}, {"mode": "tis", "upper": 2.0, "lower": None}),
    (2, {"tisCap": 1.5}, {"mode": "tis", "upper": 1.5, "lower": None}),  # the deprecated alias
    (0, {"tisCap": 1.5}, {"mode": "tis", "upper": 1.5, "lower": None}),
    (1, {"rolloutCorrection": {"mode": "token-mask", "upper": 3.0}}, {"mode": "token-mask", "upper": 3.0, "lower": None}),
    (0, {}, None)])
def test_the_trainer_config_shows_the_rollout_correction_it_uses(staleness, algorithm, want):
    """Stale rollouts (maxStaleness >= 1) are corrected with TIS at cap 2.0 when nothing is
    set, and the deprecated tisCap C becomes {mode: tis, upper: C}: resolved in the contract,
    so the mounted trainer config holds the one correction the trainer uses."""
    from rlhf_contract.trainer_config import TrainerConfig

    data = copy.deepcopy(BASE)
    data["spec"]["rollout"]["maxStaleness"] = staleness
    data["spec"]["algorithm"] = algorithm
    config = TrainerConfig.from_json(TrainerConfig.from_job(validate_job(data)).to_json())
    got = config.algorithm.rollout_correction
    assert (got.model_dump() if got else None) == want
    assert config.algorithm.tis_cap is None
    assert validate_job(data).to_config()["spec"]["algorithm"].get("tisCap") == algorithm.get("tisCap")


def errors(**spec):
    data = copy.deepcopy(BASE)
    data["spec"].update(spec)
    with pytest.raises(JobError) as info:
        validate_job(data)
    return {p.path: p.message for p in info.value.problems}


def test_cross_field_rules_on_resolved_values():
    assert "spec.algorithm.critic" in errors(algorithm={"preset": "ppo", "critic": False})
    assert "spec.algorithm.critic" in errors(algorithm={"advantageEstimator": "gae"})
    assert "spec.rollout.samplesPerPrompt" in errors(rollout={"samplesPerPrompt": 1})
    job_ok = copy.deepcopy(BASE)
    job_ok["spec"].update(rollout={"samplesPerPrompt": 1}, algorithm={"preset": "reinforce_pp"})
    validate_job(job_ok)  # a token-level estimator needs no group
    assert "spec.algorithm.overlongBuffer" in errors(algorithm={"overlongBuffer": 100})
    assert "spec.reward.file" in errors(reward={"type": "python"})
    assert "spec.reward.url" in errors(reward={"type": "http"})


def test_cispo_refuses_the_dual_clip_and_gspo_needs_whole_mini_batches():
    problem = errors(algorithm={"preset": "cispo", "dualClip": 3.0})["spec.algorithm.dualClip"]
    assert "cispo" in problem and "remove dualClip" in problem
    assert "spec.algorithm.dualClip" not in errors(algorithm={"preset": "gspo", "dualClip": 3.0},
                                                   rollout={"maxTokens": 100, "samplesPerPrompt": 3},
                                                   schedule={"promptsPerStep": 3})
    # gspo's 4 mini-batches (the paper's) must divide the step's samples: 9 do not
    assert "spec.algorithm.numMiniBatches" in errors(algorithm={"preset": "gspo"},
                                                     rollout={"maxTokens": 100, "samplesPerPrompt": 3},
                                                     schedule={"promptsPerStep": 3})


def test_reference_preset_table_is_current():
    assert preset_table() in (ROOT / "docs" / "reference.md").read_text(), "docs/reference.md is stale: run `make docs`"
