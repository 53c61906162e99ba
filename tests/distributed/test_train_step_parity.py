"""The parity matrix: the trainer's own steps on fixed data under FSDP, TP, CP and their
products equal the same step in one process, metrics and updated weights. RL's train step
(prepare + optimizer steps) for every loss aggregation, two mini-batches (the second one
off-policy: ratio != 1), truncated importance sampling, entropy bonus, dual clip, GSPO's
sequence ratio and CISPO's clipped weight, KL in the
loss and in the reward, a sampling temperature != 1 and a learned reward model; the
offline methods' step and held-out scoring (sft, rm, dpo) under FSDP. Whole runs on
several processes are compared with one process once, in tests/e2e (parallel layouts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "train_step_parity.py"
sys.path.insert(0, str(WORKER.parent))
from train_step_parity import METRIC_KEYS as KEYS, METRIC_TOLERANCE, PARAM_REL_ERR, mismatches  # noqa: E402
CASES = {
    2: ["2,1,1:grpo", "2,1,1:token-mean-2mb", "2,1,1:seq-sum-tis", "2,1,1:sum-norm-entropy:0.7",
        "1,2,1:grpo", "1,2,1:dapo-dual", "1,1,2:token-mean-2mb", "1,1,2:dapo-dual:0.7",
        "2,1,1:grpo-rm", "1,1,2:grpo-rm", "2,1,1:ppo-ac", "1,1,2:ppo-ac", "2,1,1:gspo", "1,1,2:gspo",
        "1,1,2:cispo-tis"],
    4: ["2,2,1:seq-sum-tis", "2,1,2:grpo", "1,2,2:sum-norm-entropy"],
}
OFFLINE_CASES = ["2,1,1:sft", "2,1,1:rm", "2,1,1:dpo"]
OFFLINE_KEYS = ["loss", "grad_norm", "accuracy", "reward_margin", "chosen_logratio", "eval_loss", "eval_accuracy"]


def launch(world: int, tmp_path: Path) -> dict:
    return torchrun(WORKER, world, *CASES[world], out=tmp_path / f"world{world}.json")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    two = tmp_path_factory.mktemp("step2")
    return {**torchrun(WORKER, 2, *CASES[2], *OFFLINE_CASES, out=two / "world2.json"),
            **launch(4, tmp_path_factory.mktemp("step4"))}


@pytest.mark.parametrize("case", CASES[2] + CASES[4])
def test_train_step_matches_one_process(results, case):
    r = results[case]
    got, want = r["metrics"], r["ref_metrics"]
    for key in KEYS + [k for k in ("value_loss", "critic_grad_norm", "explained_variance") if k in want]:
        if want[key] is None:
            assert got[key] is None, key
        else:
            assert got[key] == pytest.approx(want[key], **METRIC_TOLERANCE), key
    assert r["param_rel_err"] < PARAM_REL_ERR, r["worst"]  # why this bound: the worker's PARAM_REL_ERR
    # the one rule `make gpu-check`'s parity part applies (bench/gpu_check_parity.py) agrees
    extra = [k for k in ("value_loss", "critic_grad_norm", "explained_variance") if k in want]
    assert mismatches(r, KEYS + extra) == []
    assert r["moved"] > 1e-4  # the step changed the weights
    assert want["grad_norm"] > 0.3  # clipping (max 0.3) was active


def test_second_mini_batch_is_off_policy(results):
    # with two mini-batches the second one sees a moved policy: the ratio leaves 1 somewhere
    assert results["2,1,1:token-mean-2mb"]["ref_metrics"]["approx_kl"] > 0
    assert results["2,1,1:grpo"]["ref_metrics"]["approx_kl"] == 0  # one mini-batch: on-policy


@pytest.mark.parametrize("case", ["2,1,1:gspo", "1,1,2:gspo", "1,1,2:cispo-tis"])
def test_gspo_and_cispo_clip_some_tokens_and_not_others(results, case):
    # the worker moves their old log-probs (stale rollouts): the parity above then covers
    # the clipped and the unclipped branch, and GSPO's sequence means over CP ranks
    for side in ("metrics", "ref_metrics"):
        assert 0.05 < results[case][side]["clip_fraction"] < 0.95, results[case][side]["clip_fraction"]


@pytest.mark.parametrize("case", CASES[2] + CASES[4])
def test_tensor_parallel_head_never_gathers_logits(results, case):
    # under TP the policy's log-probs and entropy came from the vocabulary-parallel head
    # (every forward: prepare's no-grad pass and each micro-batch), and equal one process above
    tp = int(case.split(":")[0].split(",")[1])
    calls = results[case]["metrics"]["vocab_parallel_head_calls"]
    assert (calls > 0) if tp > 1 else (calls == 0)
    assert results[case]["ref_metrics"]["vocab_parallel_head_calls"] == 0


@pytest.mark.parametrize("case", ["2,1,1:grpo-rm", "1,1,2:grpo-rm"])
def test_learned_reward_scores_match_one_process(results, case):
    got, want = results[case]["metrics"], results[case]["ref_metrics"]
    for key in ("rm_score_mean", "rm_score_std", "reward_mean"):
        assert got[key] == pytest.approx(want[key], **METRIC_TOLERANCE), key
    assert want["rm_score_std"] > 0  # the (random) reward model told the rows apart


@pytest.mark.parametrize("case", OFFLINE_CASES)
def test_offline_step_matches_one_process(results, case):
    r = results[case]
    got, want = r["metrics"], r["ref_metrics"]
    for key in OFFLINE_KEYS:
        if want.get(key) is None:
            assert got.get(key) is None, key
        else:
            assert got[key] == pytest.approx(want[key], **METRIC_TOLERANCE), key
    assert r["param_rel_err"] < PARAM_REL_ERR, r["worst"]
    assert r["moved"] > 1e-4
