"""The CPU side of `make gpu-check`'s training parts (bench/gpu_check_parity.py,
gpu_check_memory.py, gpu_check_train.py, train_throughput.py): the parity part's own
two-rank run and judgement on CPU (gloo, the tiny model, the CPU parity tests' worker);
the memory part's pass rule and its cases; the throughput part's like-for-like pairing and
its padding-free Hugging Face peer; the engines' verdict; the junit summary."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check_memory as gm  # noqa: E402
import gpu_check_parity as gp  # noqa: E402
import gpu_check_train as gt  # noqa: E402
import train_throughput as tt  # noqa: E402

GIB = 2**30
H200_BYTES = 143771 * 2**20


# ---- parity ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_parity():
    """The parity part's own two-rank run (its spawner, this file as the ranks' entry, the
    CPU parity worker) on gloo."""
    results, ranks = gp.run_parity("cpu", ["2,1,1:grpo"], "fp32", 120)
    assert [r["exit_code"] for r in ranks] == [0, 0], ranks[0]["log_tail"]
    return results


def test_two_ranks_match_one_process_under_the_cpu_tests_rule(cpu_parity):
    [row] = gp.judge(cpu_parity, ["2,1,1:grpo"])
    assert row["holds"] and row["mismatches"] == "", row
    assert cpu_parity["2,1,1:grpo"]["moved"] > 0  # a step that changes nothing would match trivially


def test_the_judge_fails_a_metric_or_weights_beyond_the_shared_tolerances(cpu_parity):
    w = gp.worker_module()
    tol = w.METRIC_TOLERANCE
    within, beyond = copy.deepcopy(cpu_parity), copy.deepcopy(cpu_parity)
    want = cpu_parity["2,1,1:grpo"]["ref_metrics"]["grad_norm"]
    within["2,1,1:grpo"]["metrics"]["grad_norm"] = want * (1 + tol["rel"] / 2)
    beyond["2,1,1:grpo"]["metrics"]["grad_norm"] = want * (1 + tol["rel"] * 2)
    assert gp.judge(within, ["2,1,1:grpo"])[0]["holds"]
    [row] = gp.judge(beyond, ["2,1,1:grpo"])
    assert not row["holds"] and row["mismatches"].startswith("grad_norm:")
    weights = copy.deepcopy(cpu_parity)
    weights["2,1,1:grpo"]["param_rel_err"] = w.PARAM_REL_ERR * 1.01
    assert "weights: relative error" in gp.judge(weights, ["2,1,1:grpo"])[0]["mismatches"]
    assert gp.judge({}, ["1,1,2:grpo"]) == [{"case": "1,1,2:grpo", "holds": False, "mismatches": "no result"}]


def test_the_gpu_cases_are_fsdp_and_context_parallel_grpo_of_the_cpu_matrix():
    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    from test_train_step_parity import CASES  # the CPU matrix

    assert gp.PARITY_CASES == ["2,1,1:grpo", "1,1,2:grpo"]
    assert "2,1,1:grpo" in CASES[2] and all(c.split(":")[1] in gp.worker_module().VARIANTS for c in gp.PARITY_CASES)


def test_each_rank_shares_gpu_0_with_a_host_id_of_its_own():
    envs = [gp.rank_env(r, 2, 1234, base={}) for r in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"] and [e["RANK"] for e in envs] == ["0", "1"]
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert {e["MASTER_PORT"] for e in envs} == {"1234"} and all(e["WORLD_SIZE"] == "2" for e in envs)


def test_a_rank_past_its_deadline_is_killed_and_reported():
    ranks = gp.spawn_ranks(["-c", "import os, time; time.sleep(0 if os.environ['RANK'] == '0' else 60)"], 2, 3)
    assert ranks[0]["exit_code"] == 0 and ranks[1]["exit_code"] is None


# ---- memory ------------------------------------------------------------------------------

def test_the_pass_rule_covers_the_reserved_peak_and_bounds_the_overestimate():
    reserved = 40 * GIB
    assert gm.plan_verdict(reserved, reserved) == "holds"
    assert gm.plan_verdict(int((1 + gm.PLAN_OVER_LIMIT) * reserved), reserved) == "holds"
    assert gm.plan_verdict(reserved - 1, reserved).startswith("under:")
    assert gm.plan_verdict(int((1 + gm.PLAN_OVER_LIMIT) * reserved) + GIB // 100, reserved).startswith("over:")
    # outside the allocator (context + NCCL): judged where measured, ignored where not (two ranks on one GPU)
    assert gm.plan_verdict(reserved, reserved, GIB, 2 * GIB).startswith("under outside the allocator")
    assert gm.plan_verdict(reserved, reserved, GIB, None) == "holds"


def test_the_rule_is_the_bound_the_tuned_rows_were_already_held_to():
    # one number, fixed before the new cases ran: test_memory_plan_on_gpu.py uses it for the old rows
    text = (ROOT / "tests/unit/test_memory_plan_on_gpu.py").read_text()
    assert "1 + PLAN_OVER_LIMIT" in text and "1.10" not in text


def test_the_cases_are_the_issues_and_none_is_a_tuned_row():
    cases = {c.name: c for c in gm.MEMORY_CASES}
    assert {(c.tokens, c.checkpointing) for c in gm.MEMORY_CASES if c.checkpointing} == {(16384, True), (32768, True)}
    assert [c.world for c in gm.MEMORY_CASES if c.world > 1] == [2]
    [varying] = [c for c in gm.MEMORY_CASES if c.varying]
    tuned = {("0.5b", 4096), ("0.5b", 8192), ("0.5b", 16384), ("1.5b", 4096), ("1.5b", 16384)}
    single = [c for c in cases.values() if not c.varying and c.world == 1]
    assert all(c.checkpointing or (c.shape, c.tokens) not in tuned for c in single)
    vocab = gm.QWEN2_SHAPES["1.5b"]["vocab_size"]
    steps = gm.case_batches(varying, vocab)
    lengths = [sum(len(r.prompt_ids) + len(r.response_ids) for r in rows) for rows in steps]
    assert len(steps) == 10 and len(set(lengths)) == 10 and max(lengths) > 20 * min(lengths)
    longest = max(len(r.prompt_ids) + len(r.response_ids) for rows in steps for r in rows)
    assert longest <= varying.tokens  # every document fits a micro-batch
    for case in cases.values():
        if not case.varying:  # about two micro-batches per rank, as the 2026-11-26 cases had
            rows = gm.case_batches(case, vocab)[0]
            per_rank = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows) / case.world
            assert case.tokens < per_rank <= 2.5 * case.tokens, (case, per_rank)


def test_every_case_is_planned_to_fit_an_h200_with_checkpointing_as_asked():
    from rlhf_trainer.preflight import memory_plan as mp

    for case in gm.MEMORY_CASES:
        plan = mp.plan(gm._config(case.tokens, case.checkpointing), gm.QWEN2_SHAPES[case.shape], case.world, H200_BYTES)
        assert plan.total <= H200_BYTES, case
        if case.checkpointing is not None:
            assert plan.activation_checkpointing is case.checkpointing, case
    two = mp.plan(gm._config(16384, None), gm.QWEN2_SHAPES["1.5b"], 2, H200_BYTES)
    one = mp.plan(gm._config(16384, None), gm.QWEN2_SHAPES["1.5b"], 1, H200_BYTES)
    assert two.total - two.fixed < one.total - one.fixed  # FSDP2 over two ranks: each holds half the states


# ---- throughput --------------------------------------------------------------------------

def test_each_pair_differs_only_in_the_side():
    pairs = tt.pairings([False, True])
    assert [(side, ckpt) for _, side, ckpt in pairs] == [("ours", False), ("peer", False),
                                                         ("ours", True), ("peer", True)]
    assert len({label for label, _, _ in pairs}) == 4
    results = [{"side": s, "checkpointing": c, "seconds": t} for (_, s, c), t in zip(pairs, [1.0, 2.0, 4.0, None])]
    assert tt.ratios(results) == {False: 2.0, True: None}  # ours twice as fast; a side out of memory: no ratio


def test_plain_hf_packs_documents_without_padding_or_attention_across_them():
    assert tt.can_pack()  # this transformers builds per-document masks from position_ids
    seqs = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    chunks = tt.pack(seqs, 9)
    assert chunks == [[[5, 6, 7, 8], [9, 10, 11]], [[12, 13, 14, 15, 16], [17, 18]]]
    assert tt.pack([[1] * 12, [2]], 9) == [[[1] * 12], [[2]]]  # a document longer than the budget: alone
    model = tt.build("tiny", torch.device("cpu")).eval()
    for packed in (True, False):
        ids, kwargs, mask = tt.hf_inputs(chunks[0], packed, torch.device("cpu"))
        with torch.no_grad():
            logits = model(input_ids=ids, **kwargs).logits
            alone = [model(input_ids=torch.tensor([s])).logits[0] for s in chunks[0]]
        if packed:  # one row of 7 real tokens, no loss across the boundary
            assert ids.shape == (1, 7) and mask.tolist() == [[1, 1, 1, 0, 1, 1]]
            torch.testing.assert_close(logits[0], torch.cat(alone), rtol=1e-4, atol=1e-5)
        else:  # the padded fallback computes 8 tokens for 7
            assert ids.shape == (2, 4) and mask.sum() == 5
            torch.testing.assert_close(logits[1, :3], alone[1], rtol=1e-4, atol=1e-5)


# ---- engines and the gpu-marked tests ----------------------------------------------------

ENGINES_ON_CPU = """
import json, os, sys, tempfile
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
import gpu_check_train as gt
from rlhf_trainer.models.builtin import build_tiny_qwen2
model_dir = tempfile.mkdtemp()
model = build_tiny_qwen2(0)
model.save_pretrained(model_dir)
print("ROWS " + json.dumps(gt.run_engines(model_dir, torch.device("cpu"), model.config.vocab_size)))
"""


def test_the_engines_part_trains_zero2_zero3_and_lora_through_the_trainers_own_loading():
    """The part's own code on CPU (gloo, the tiny model): a process launched without torchrun
    (as gpu-check's part is) still gives DeepSpeed the environment it asserts on."""
    from helpers import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    res = subprocess.run([sys.executable, "-c", ENGINES_ON_CPU, str(ROOT / "bench"), str(free_port())],
                         capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    line = next((x for x in res.stdout.splitlines() if x.startswith("ROWS ")), None)
    assert line, res.stderr[-3000:]
    rows = {r["engine"]: r for r in json.loads(line[5:])}
    assert list(rows) == list(gt.ENGINE_CASES)
    for name, row in rows.items():
        assert row["verdict"] == "holds", row
        assert len(row["losses"]) == gt.ENGINE_STEPS
    # the same rows, on-policy: the same loss under every engine; LoRA trains adapters only
    assert rows["ZeRO-2"]["losses"][0] == pytest.approx(rows["ZeRO-3"]["losses"][0], rel=1e-4)
    assert rows["ZeRO-2"]["losses"][0] == pytest.approx(rows["LoRA (FSDP2)"]["losses"][0], rel=1e-4)
    assert rows["LoRA (FSDP2)"]["trainable parameters"] < rows["ZeRO-2"]["trainable parameters"] / 2


def test_an_engine_case_passes_on_finite_unskipped_steps_only():
    assert gt.engine_verdict([0.1, 0.0, -0.2], [0, 0, 0]) == "holds"
    assert gt.engine_verdict([0.1, float("nan")], [0, 0]).startswith("non-finite")
    assert gt.engine_verdict([0.1, 0.2], [0, 1]).startswith("skipped steps")
    assert gt.engine_verdict([], []) == "no step completed"
    assert gt.deepspeed_import_error() is None  # the pinned venv's deepspeed imports (the GPU machine's may not)
    assert set(gt.ENGINE_CASES) == {"ZeRO-2", "ZeRO-3", "LoRA (FSDP2)"}


def test_the_junit_summary_counts_and_names_failures(tmp_path):
    (tmp_path / "test_x.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
                                        "@pytest.mark.skip(reason='x')\ndef test_skip():\n    pass\n")
    junit = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                    f"--junitxml={junit}", str(tmp_path / "test_x.py")], cwd=tmp_path, capture_output=True, timeout=60)
    summary = gt.junit_summary(str(junit))
    assert {k: summary[k] for k in ("tests", "failures", "errors", "skipped")} == \
        {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}
    assert summary["failed"] == ["test_x::test_bad"]


def test_a_pytest_run_cut_at_its_box_still_leaves_its_junit_report(tmp_path):
    (tmp_path / "test_y.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_slow():\n    time.sleep(120)\n")
    junit = tmp_path / "j.xml"
    start = time.monotonic()
    log, code, cut = gt.run_cut([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                                 f"--junitxml={junit}", "test_y.py"], str(tmp_path), 15)
    # run_cut gives the child SIGINT at its default: this test failed (no report) when the suite
    # itself ran as a background job, which starts with SIGINT ignored and passes that on
    assert cut and code != 0 and time.monotonic() - start < 60
    summary = gt.junit_summary(str(junit))
    assert summary["tests"] >= 1 and summary["failures"] == 0, (summary, log[-2000:])
