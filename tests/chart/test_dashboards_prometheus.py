"""A real Prometheus (Debian's package, unpacked by `make prometheus-tools`) scrapes a
trainer's MetricsWriter and the operator's metrics endpoint, each in its own process; then
every query of the chart's Grafana dashboards must return finite data for them, except the
panels marked "(GPU only)" or "(vLLM servers)" (no GPU, no vLLM here), which must still
parse and run; the vLLM names they query are checked against vLLM's own source
(tests/chart/test_chart_files.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml

from helpers import free_port

from .conftest import CHART, prometheus_bin

TRAINER = textwrap.dedent("""
    import sys, time
    from rlhf_trainer.metrics import MetricsWriter
    w = MetricsWriter(sys.argv[1], port=int(sys.argv[2]))
    step = 0
    while True:  # what a CPU run loop writes each step (no MFU or GPU memory without a GPU)
        step += 1
        w.write({"step": step, "policy_version": step, "reward_mean": 0.1 * step, "score_mean": 0.1 * step,
                 "response_length_mean": 12.0, "truncated_fraction": 0.0, "dropped_group_fraction": 0.0,
                 "logprob_mismatch": 0.01, "loss": 0.5, "clip_fraction": 0.05, "approx_kl": 0.001, "entropy": 1.2,
                 "kl": 0.02, "grad_norm": 0.8, "critic_grad_norm": 0.3, "skipped_steps": 0, "advantage_mean": 0.0,
                 "advantage_std": 1.0, "padding_fraction": 0.1, "learning_rate": 1e-3, "step_seconds": 0.5,
                 "rollout_seconds": 0.3, "train_seconds": 0.15, "weight_sync_seconds": 0.05,
                 "tokens_per_second": 900.0, "mfu": None, "peak_gpu_memory_bytes": None,
                 # spec.evaluation, and an offline (rm / dpo) job's pair metrics
                 "eval/held-out/greedy_score": 0.2, "eval/held-out/mean_score": 0.1, "eval/held-out/pass@4": 0.5,
                 "num_tokens": 450, "reward_std": 0.3, "reward_min": 0.0, "reward_max": 1.0,
                 "response_length_min": 3, "response_length_max": 20, "zero_std_group_fraction": 0.25,
                 "reward/correct_mean": 0.5, "reward/format_mean": 0.9,
                 "accuracy": 0.7, "reward_margin": 0.4, "eval/held_out/accuracy": 0.65,
                 "eval/held_out/reward_margin": 0.3})
        time.sleep(0.5)
""")
OPERATOR = textwrap.dedent("""
    import sys, time
    from rlhf_operator import metrics
    metrics.serve(int(sys.argv[1]))
    metrics.LEADER.set(1)
    metrics.RESTARTS.inc()
    while True:  # what reconciles record
        for trigger in metrics.TRIGGERS:
            metrics.RECONCILES.labels(trigger=trigger).inc()
        metrics.DURATION.observe(0.02)
        metrics.ERRORS.labels(error="ApiException").inc()
        metrics.set_jobs_by_phase(["Running", "Running", "Failed"])
        time.sleep(0.5)
""")




def _queries() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                out.append((path.name, panel["title"], t["expr"]))
    return out


def _concrete(expr: str) -> str:
    """Grafana's variables replaced as Grafana would with "All" selected."""
    return expr.replace("$__rate_interval", "30s").replace("$namespace", ".*").replace("$rlhf_job", ".*")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    bindir = prometheus_bin()
    if bindir is None or not (bindir / "prometheus").is_file():
        pytest.skip("prometheus is not unpacked: run `make prometheus-tools` (Debian's prometheus package)")
    tmp = tmp_path_factory.mktemp("prometheus")
    trainer_port, operator_port, prom_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp / "out"), str(trainer_port)], env=env),
             subprocess.Popen([sys.executable, "-c", OPERATOR, str(operator_port)], env=env)]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            # the labels the chart's trainer PodMonitor adds (namespace, rlhf_job)
            {"job_name": "trainer", "static_configs": [{"targets": [f"127.0.0.1:{trainer_port}"],
                                                         "labels": {"namespace": "ml", "rlhf_job": "demo"}}]},
            {"job_name": "operator", "static_configs": [{"targets": [f"127.0.0.1:{operator_port}"]}]},
        ]}))
    log = open(tmp / "prometheus.log", "wb")
    procs.append(subprocess.Popen([str(bindir / "prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                up = httpx.get(f"{url}/api/v1/query", params={"query": "up"}, timeout=2).json()["data"]["result"]
                if len(up) == 2 and all(r["value"][1] == "1" for r in up):
                    break
            except (httpx.HTTPError, ValueError):  # not listening yet, or 503 "Service Unavailable" (not JSON)
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus did not scrape both targets:\n{(tmp / 'prometheus.log').read_text()[-3000:]}")
            time.sleep(0.5)
        time.sleep(6)  # several scrapes: rates and increases need two samples in their window
        yield url
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()


@pytest.mark.parametrize("dashboard, title, expr", _queries(), ids=[f"{d}:{t}" for d, t, _ in _queries()])
def test_dashboard_query_returns_data(prometheus, dashboard, title, expr):
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": _concrete(expr)}, timeout=10).json()
    assert body["status"] == "success", f"{dashboard} / {title}: {expr}: {body}"
    if "(GPU only)" in title or "(vLLM servers)" in title:
        return  # parses and runs; only a GPU trainer, or a vLLM server, reports a value
    values = [float(r["value"][1]) for r in body["data"]["result"]]
    assert values and all(math.isfinite(v) for v in values), f"{dashboard} / {title}: {expr} returned {values}"


def test_dashboard_variables_find_the_job(prometheus):
    for var in json.loads((CHART / "dashboards" / "training-run.json").read_text())["templating"]["list"]:
        if var["type"] != "query":
            continue
        # label_values(<series selector>, <label>) is Grafana's; the same lookup in Prometheus' API:
        inner = var["query"]["query"][len("label_values("):-1]
        selector, label = inner.rsplit(",", 1)
        r = httpx.get(f"{prometheus}/api/v1/label/{label.strip()}/values",
                      params={"match[]": _concrete(selector)}, timeout=10).json()
        assert r["status"] == "success" and r["data"], (var["name"], r)
