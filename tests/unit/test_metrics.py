"""Trainer metrics: metrics.jsonl and the Prometheus endpoint on rank 0."""

import json
import time

import httpx

from rlhf_launcher.local import free_port, summarize
from rlhf_trainer.metrics import MetricsWriter, exported_names


def test_jsonl_prometheus_and_resume_truncation(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("RLHF_METRICS_PORT", str(port))
    writer = MetricsWriter(tmp_path / "out")
    for step in (1, 2, 3):
        writer.write({"step": step, "reward_mean": step / 4, "kl": None})
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in lines] == [0.25, 0.5, 0.75]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert "rlhf_reward_mean 0.75" in text and "rlhf_step 3.0" in text
    assert "rlhf_kl NaN" in text  # null: no value (NaN), not a stale or zero one
    assert "rlhf_value_loss NaN" in text  # declared up front although no row had it
    stamp = float(next(l for l in text.splitlines() if l.startswith("rlhf_last_step_timestamp_seconds ")).split()[1])
    assert abs(stamp - time.time()) < 60
    writer.truncate_after(1)  # a run resumed from step 1 rewrites steps 2 and 3
    assert [json.loads(line)["step"] for line in writer.path.read_text().splitlines()] == [1]


def _samples(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_prometheus_conventions_counters_ratios_and_labelled_families(tmp_path):
    writer = MetricsWriter(tmp_path / "out", port=free_port())
    from prometheus_client import generate_latest

    rows = [{"step": 1, "dropped_prompts": 3, "skipped_steps": 1, "num_tokens": 100, "tokens_per_second": 50.0,
             "truncated_fraction": 0.25, "step_seconds": 2.0, "weight_sync_seconds": 0.5,
             "reward/format_mean": 0.5, "reward/math_mean": 0.25, "eval/gsm/pass@4": 0.75, "eval/gsm/greedy_score": 0.5},
            {"step": 2, "dropped_prompts": 5, "skipped_steps": 0, "num_tokens": 60, "tokens_per_second": 30.0,
             "truncated_fraction": None, "step_seconds": 1.5, "weight_sync_seconds": 0.25, "reward/format_mean": 1.0,
             "reward/style_parse_failures": 3, "reward/style_judge_tokens": 1200, "reward/style_mean": 0.5}]
    for row in rows:
        writer.write(row)
    got = _samples(generate_latest(writer.registry).decode())
    assert got["rlhf_dropped_prompts_total"] == 5.0  # a count so far: the counter follows it, not 3 + 5
    assert got["rlhf_skipped_optimizer_steps_total"] == 1.0 and got["rlhf_tokens_total"] == 160.0  # sums of steps
    assert got["rlhf_steps_total"] == 2.0
    assert got['rlhf_step_duration_seconds{phase="step"}'] == 1.5
    assert got['rlhf_step_duration_seconds{phase="weight_sync"}'] == 0.25
    assert got['rlhf_reward_component_mean{component="format"}'] == 1.0
    assert got['rlhf_reward_component_mean{component="math"}'] == 0.25
    assert got['rlhf_judge_parse_failures_total{component="style"}'] == 3.0  # a judge's counters, not its mean
    assert got['rlhf_judge_tokens_total{component="style"}'] == 1200.0
    assert got['rlhf_reward_component_mean{component="style"}'] == 0.5
    assert got['rlhf_eval_pass_at_k_ratio{dataset="gsm",k="4"}'] == 0.75
    assert got['rlhf_eval_greedy_score{dataset="gsm"}'] == 0.5
    assert str(got["rlhf_truncated_ratio"]) == "nan"  # null in the last row: no stale value
    assert not any("per_second" in name or "fraction" in name for name in got)


def test_summary_of_first_and_last_ten_steps():
    rows = [{"reward_mean": 0.1}] * 10 + [{"reward_mean": 0.5}] * 5 + [{"reward_mean": 0.9}] * 10
    assert summarize(rows) == "reward_mean: first 10 steps 0.100, last 10 steps 0.900 (9.0x)"
    assert summarize([]) == "no steps completed"


def test_each_writer_has_its_own_registry_and_only_declared_names(tmp_path):
    a, b = MetricsWriter(tmp_path / "a", port=free_port()), MetricsWriter(tmp_path / "b", port=free_port())
    a.write({"step": 1, "reward_mean": 0.5, "not_declared": 3.0})
    b.write({"step": 7})
    from prometheus_client import generate_latest
    text_a, text_b = generate_latest(a.registry).decode(), generate_latest(b.registry).decode()
    assert "rlhf_step 1.0" in text_a and "rlhf_step 7.0" in text_b  # no shared global registry
    exported = {line.split()[2] for line in text_a.splitlines() if line.startswith("# TYPE")}
    assert exported == exported_names()  # stable names: a row key never creates a new metric
    assert "not_declared" in (tmp_path / "a" / "metrics.jsonl").read_text()  # still in the jsonl


def test_mfu_peak_flops_and_logprob_mismatch():
    import torch

    from rlhf_trainer.metrics import logprob_mismatch, peak_flops, peak_gpu_memory_bytes, train_mfu

    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("cpu") is None
    # 1.5e9 params, 43k tokens, 3 passes: 3.87e14 FLOPs in 1 s on one H100 -> about 39%.
    mfu = train_mfu(num_params=1_500_000_000, tokens=43_000, train_seconds=1.0, world_size=1,
                    device_peak_flops=989e12)
    assert abs(mfu - 3 * 2 * 1.5e9 * 43_000 / 989e12) < 1e-12 and 0.39 < mfu < 0.40
    assert train_mfu(num_params=10, tokens=10, train_seconds=1.0, world_size=1, device_peak_flops=None) is None
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the -9 is padding: ignored
    assert logprob_mismatch(lp, rollout, mask) == (0.5 + 0 + 0 + 1.0) / 4
    if not torch.cuda.is_available():
        assert peak_gpu_memory_bytes() is None


def test_pods_of_other_nodes_answer_prometheus_without_step_series(monkeypatch):
    from rlhf_trainer.launch import serve_node_endpoint

    port = free_port()
    monkeypatch.setenv("RLHF_METRICS_PORT", str(port))
    monkeypatch.setenv("PET_NODE_RANK", "0")
    assert serve_node_endpoint([]) is None  # node 0: its rank-0 process serves the step metrics there
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert serve_node_endpoint(["--nnodes=2"]) == port
    res = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert res.status_code == 200 and "rlhf_" not in res.text  # up, and no series to double-count
    monkeypatch.delenv("PET_NODE_RANK")
    monkeypatch.setenv("RLHF_METRICS_PORT", str(free_port()))
    assert serve_node_endpoint(["--node-rank", "0"]) is None
