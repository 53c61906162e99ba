"""`make gpu-check`'s `pair` and `failures` parts (bench/gpu_check_pair.py) run on the CPU:
the same harness with backend "gloo" (the sender's GlooTransport; the receivers,
bench/gpu_check_receiver.py, join as the CPU engine does) and a tiny Qwen2 shape. Real
processes: the trainer pod's launcher starts the real trainer main, whose loop drives the
real WeightSyncSender against receivers speaking the weight-transfer HTTP routes; the
sha256 of every tensor is compared with values computed here; failures are injected for
real (SIGKILL, SIGSTOP mid-transfer, a receiver that never joins) and end with exit 75
within their deadlines; a bad NCCL_SOCKET_IFNAME fails the real ncclGetUniqueId and must
end with exit 2 (a config error: the trainer can never start its group).

All five cases run at once (about 30 s: the stopped receiver costs the round's timeout plus
the sender's bounded /shutdown_weight_transfer_engine)."""

from __future__ import annotations

import concurrent.futures as cf
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check_pair as pair  # noqa: E402
from gpu_check_parts import QWEN2_SHAPES  # noqa: E402

TIMEOUT_S = 3.0
"""The round's time limit (rollout.weightSyncTimeoutSeconds) in the failure cases."""
START_S = 20.0
"""A trainer process's start-up here, six at once on a shared machine (part of two deadlines)."""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The pair (two receivers) and the four failure cases, all at once."""
    root = tmp_path_factory.mktemp("pair")
    deadlines = pair.failure_deadlines(TIMEOUT_S, START_S)
    common = dict(backend="gloo", device="cpu", shape="tiny", bucket_bytes=64 << 10)
    runs = {"2 receivers": dict(receivers=2, rounds=2, timeout_s=30, deadline_s=120)}  # one receiver: the same code
    runs.update({case: dict(fault=case, timeout_s=TIMEOUT_S, deadline_s=deadlines[case]) for case in pair.EXPECTED})
    with cf.ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(pair.run_case, root / name.replace(" ", "-"), **common, **kw)
                   for name, kw in runs.items()}
        return {name: f.result() for name, f in futures.items()}


def test_the_1_5b_set_is_qwen2s_own_parameters():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = QWEN2_SHAPES["1.5b"]
    assert all(shape[k] == v for k, v in pair.QWEN2_1_5B.items())
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in shape.items() if k != "model_type"}))
    theirs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert pair.qwen2_tensors(pair.QWEN2_1_5B) == theirs
    assert 1.5e9 < sum(p.numel() for p in model.parameters()) < 1.6e9  # 3.1 GB in bf16


def test_the_weights_are_deterministic_bf16():
    a, b = pair.make_weights("tiny", torch.device("cpu")), pair.make_weights("tiny", torch.device("cpu"))
    assert list(a) == [n for n, _ in pair.qwen2_tensors(pair.TINY)] and "lm_head.weight" in a
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, b[n]) for n, t in a.items())
    assert pair.sha256(a["model.norm.weight"]) != pair.sha256(a["model.layers.0.input_layernorm.weight"])


# The lines below are NCCL 2.28.9's own format strings (src/debug.cc's prefix "%s:%d:%d " and
# "[%d] NCCL INFO ", after an optional "[%F %T] " timestamp; init.cc, transport/net.cc, p2p.cc, shm.cc)
# filled in with Python's % operator, which reads them as C's printf does.
PREFIX = "%s:%d:%d " % ("gpu-host", 4242, 4250) + "[%d] NCCL INFO " % 0
NET_SEND = "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s"
NET_RECEIVE = "Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s"


def test_the_nccl_log_parser_reads_ncclss_own_lines():
    socket_log = "\n".join([
        "%s:%d:%d " % ("gpu-host", 4242, 4250) + "[%d] NCCL INFO " % 0 + "%s" % "NCCL version 2.28.9+cuda13.0",
        PREFIX + "Using network %s" % "Socket",
        PREFIX + NET_SEND % (0, 0, 0, 0, 1, 0, "Socket", 0, "", "", ""),
        PREFIX + NET_RECEIVE % (1, 0, 2, 0, 0, 0, "Socket", 0, "", "", ""),
        PREFIX + NET_SEND % (1, 0, 0, 0, 1, 0, "Socket", 0, "", "", ""),
        "[2026-11-28 23:40:01] " + PREFIX + "comm 0x5 rank 0 nranks 3 cudaDev 0 - Init COMPLETE"])
    assert pair.parse_nccl_log(socket_log) == {"network": "Socket", "via": ["NET/Socket/0"],
                                               "version": "2.28.9+cuda13.0", "warnings": []}
    assert pair.network_label(pair.parse_nccl_log(socket_log)) == "Socket (NET/Socket/0)"
    ib_log = "\n".join(["[2026-11-28 23:40:01] " + PREFIX + "Using network %s" % "IB",
                        PREFIX + NET_SEND % (0, 1, 0, 0, 1, 0, "IB", 3, "/GDRDMA", "", "/Shared"),
                        PREFIX + "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/IPC%s%s" % (2, 0, 0, 0, 1, 0, "", ""),
                        PREFIX + "Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s" % (3, 0, 0, 1, 0, "direct", "direct")])
    parsed = pair.parse_nccl_log(ib_log)
    assert parsed["network"] == "IB" and parsed["via"] == ["NET/IB/3/GDRDMA/Shared", "P2P/IPC"]
    assert pair.network_label(pair.parse_nccl_log("")) == "no NCCL log"
    refused = ("\n[2026-11-28 23:40:01] " + "%s:%d:%d " % ("gpu-host", 4242, 4250) + "[%d] %s:%d NCCL WARN " % (
        0, "init.cc", 904) + "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx" % (1, 0, 0x1b000))
    assert pair.parse_nccl_log(refused)["warnings"] == [
        "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000"]


def test_the_real_sender_reaches_every_receiver_bit_for_bit(cases):
    receivers, case = 2, cases["2 receivers"]
    assert case["exit_code"] == 0, case.get("trainer_log_tail")
    assert case["world_size"] == 1 + receivers and case["backend"] == "gloo" and case["buckets"] > 3
    expected = {n: pair.sha256(t) for n, t in pair.make_weights("tiny", torch.device("cpu")).items()}
    assert case["_checksums"]["sent"] == expected  # computed here, not taken from the trainer's word
    assert case["_checksums"]["received"] == [expected] * receivers
    assert case["checksums_match"] and case["mismatched"] == [[]] * receivers and case["ok"]
    assert len(case["gb_per_s"]) == 2 and all(x > 0 for x in case["update_seconds"])


@pytest.mark.parametrize("fault", ["killed", "stopped", "never joins"])
def test_a_lost_receiver_ends_the_trainer_with_exit_75_within_its_deadline(cases, fault):
    case = cases[fault]
    assert case["exit_code"] == 75, case
    assert case["seconds"] <= case["deadline_s"] == pair.failure_deadlines(TIMEOUT_S, START_S)[fault]
    message = case["termination_message"]
    assert message.startswith("rank 0: WeightSyncError: ")
    if fault == "killed":  # at once, not at the round's deadline
        assert case["seconds"] < TIMEOUT_S
    else:  # nothing fails: the round's (or init's) time limit ends it
        assert "timed out" in message


def test_a_bad_interface_name_ends_the_trainer_with_exit_2(cases):
    case = cases["bad interface"]
    assert pair.BAD_INTERFACE in case["termination_message"]
    assert "ncclGetUniqueId" in case["termination_message"]
    assert case["exit_code"] == 2, case["termination_message"]
    assert case["seconds"] <= case["deadline_s"]


def test_the_parts_report_their_cases(cases):
    report = pair.pair_report([cases["2 receivers"]])
    assert report["status"] == "ok" and "_checksums" not in report["cases"][0]
    assert report["tables"]["sender to receivers"][0]["sha256 equal"] is True
    assert "sha256 of 27 tensors equal" in report["summary"]
    failures = pair.failures_report([cases[name] for name in pair.EXPECTED])
    assert [row["expected"] for row in failures["tables"]["failures injected"]] == [75, 75, 75, 2]
    assert "killed: exit 75 (expected 75)" in failures["summary"]
    assert failures["status"] == ("ok" if cases["bad interface"]["exit_code"] == 2 else "failed")


def test_a_case_the_harness_cannot_run_fails_alone_with_its_reason():
    def refused():
        raise RuntimeError("the receiver at http://127.0.0.1:1 did not start")

    case = pair.guarded("killed", 75, 17.0, refused)
    assert case == {"case": "killed", "ok": False, "expected": 75, "deadline_s": 17.0,
                    "error": "RuntimeError('the receiver at http://127.0.0.1:1 did not start')"}
    report = pair.failures_report([case])
    assert report["status"] == "failed" and report["tables"]["failures injected"][0]["exit"] is None
    broken = pair.pair_report([pair.guarded("1 receiver(s)", None, 240, refused) | {"receivers": 1}])
    assert broken["status"] == "failed" and "did not start" in broken["summary"]


def test_the_nonblocking_case_is_nccl_only_and_reported_with_its_abort():
    """"never joins (non-blocking formation)" runs on the GPU only: the gloo harness has no
    NCCL formation to abort (GlooTransport ignores RLHF_NCCL_NONBLOCKING_INIT), so on the CPU it
    would repeat "never joins". Here: its expectations and how the report shows it."""
    assert pair.NONBLOCKING not in pair.EXPECTED and pair.NCCL_ONLY == {pair.NONBLOCKING: 75}
    deadlines = pair.failure_deadlines(TIMEOUT_S, START_S)
    assert deadlines[pair.NONBLOCKING] == deadlines["never joins"]
    case = {"case": pair.NONBLOCKING, "exit_code": 75, "expected": 75, "seconds": 14.2, "deadline_s": 49.0,
            "ok": True, "formation_aborted": False}
    report = pair.failures_report([case])
    assert report["tables"]["failures injected"][0]["formation aborted"] is False
    assert report["summary"].endswith("in 14.2 s of 49.0, formation aborted: False")
    from rlhf_trainer.weight_sync import transport

    assert pair.FORMATION_ABORTED in Path(transport.__file__).read_text()  # the line the report looks for


def test_the_config_probe_reports_that_the_cpu_cannot_show_the_config_read():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    probe = pair.config_probe()
    assert probe["read"] is False, probe
    assert probe["ours"].startswith("code 1: ncclCommInitRankConfig failed: NCCL error 1: unhandled cuda error")
    assert probe["wrong magic"] == probe["ours"]  # NCCL stops at cudaGetDevice before the config
