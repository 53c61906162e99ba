"""Trainer metrics: metrics.jsonl and the Prometheus endpoint on rank 0."""

import json

import httpx

from rlhf_launcher.local import free_port, summarize
from rlhf_trainer.metrics import MetricsWriter


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
    assert "rlhf_kl" not in text  # null values are not exported
    writer.truncate_after(1)  # a run resumed from step 1 rewrites steps 2 and 3
    assert [json.loads(line)["step"] for line in writer.path.read_text().splitlines()] == [1]


def test_summary_of_first_and_last_ten_steps():
    rows = [{"reward_mean": 0.1}] * 10 + [{"reward_mean": 0.5}] * 5 + [{"reward_mean": 0.9}] * 10
    assert summarize(rows) == "reward_mean: first 10 steps 0.100, last 10 steps 0.900 (9.0x)"
    assert summarize([]) == "no steps completed"
