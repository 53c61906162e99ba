"""Prometheus metrics of the operator (prometheus-client), served on `--metrics-port`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("rlhf_operator_reconciles_total", "Reconciles of RLHFJobs, by trigger.", ["trigger"])
ERRORS = Counter("rlhf_operator_reconcile_errors_total", "Reconciles that raised, by exception type.", ["error"])
DURATION = Histogram("rlhf_operator_reconcile_duration_seconds", "Wall time of one reconcile.",
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RESTARTS = Counter("rlhf_operator_job_restarts_total", "Whole-job restarts started by the operator.")
JOBS = Gauge("rlhf_operator_jobs", "RLHFJobs by phase (updated on every resync).", ["phase"])
LEADER = Gauge("rlhf_operator_leader", "1 while this process holds the leader lease.")

PHASES = ("Pending", "Initializing", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


def set_jobs_by_phase(phases: list[str]) -> None:
    for phase in PHASES:
        JOBS.labels(phase=phase).set(sum(p == phase for p in phases))


def serve(port: int) -> None:
    if port:
        start_http_server(port)
