"""The trainer's own train step (prepare + optimizer steps) on fixed rows under FSDP, TP,
CP and their products equals the same step in one process: metrics and the updated
weights, for every loss aggregation, two mini-batches (the second one off-policy: ratio
!= 1), truncated importance sampling, entropy bonus, dual clip, KL in the loss and in the
reward, and a sampling temperature != 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "train_step_parity.py"
CASES = {
    2: ["2,1,1:grpo", "2,1,1:token-mean-2mb", "2,1,1:seq-sum-tis", "2,1,1:sum-norm-entropy:0.7",
        "1,2,1:grpo", "1,2,1:dapo-dual", "1,1,2:token-mean-2mb", "1,1,2:dapo-dual:0.7"],
    4: ["2,2,1:seq-sum-tis", "2,1,2:grpo", "1,2,2:sum-norm-entropy"],
}
KEYS = ["loss", "clip_fraction", "approx_kl", "entropy", "kl", "grad_norm", "advantage_mean", "skipped_steps"]


def launch(world: int, tmp_path: Path) -> dict:
    return torchrun(WORKER, world, *CASES[world], out=tmp_path / f"world{world}.json")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return {**launch(2, tmp_path_factory.mktemp("step2")), **launch(4, tmp_path_factory.mktemp("step4"))}


@pytest.mark.parametrize("case", CASES[2] + CASES[4])
def test_train_step_matches_one_process(results, case):
    r = results[case]
    got, want = r["metrics"], r["ref_metrics"]
    for key in KEYS:
        if want[key] is None:
            assert got[key] is None, key
        else:
            assert got[key] == pytest.approx(want[key], rel=2e-4, abs=1e-6), key
    # Adam divides by sqrt(v): for parameters whose true gradient is ~0 (the key bias: softmax
    # ignores a shift shared by all keys) float noise becomes an lr-sized update, hence 1e-3
    assert r["param_rel_err"] < 1e-3, r["worst"]
    assert r["moved"] > 1e-4  # the step changed the weights
    assert want["grad_norm"] > 0.3  # clipping (max 0.3) was active


def test_second_mini_batch_is_off_policy(results):
    # with two mini-batches the second one sees a moved policy: the ratio leaves 1 somewhere
    assert results["2,1,1:token-mean-2mb"]["ref_metrics"]["approx_kl"] > 0
    assert results["2,1,1:grpo"]["ref_metrics"]["approx_kl"] == 0  # one mini-batch: on-policy


@pytest.mark.parametrize("case", CASES[2] + CASES[4])
def test_tensor_parallel_head_never_gathers_logits(results, case):
    # under TP the policy's log-probs and entropy came from the vocabulary-parallel head
    # (every forward: prepare's no-grad pass and each micro-batch), and equal one process above
    tp = int(case.split(":")[0].split(",")[1])
    calls = results[case]["metrics"]["vocab_parallel_head_calls"]
    assert (calls > 0) if tp > 1 else (calls == 0)
    assert results[case]["ref_metrics"]["vocab_parallel_head_calls"] == 0
