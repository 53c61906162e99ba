"""Prometheus metrics of the operator (prometheus-client), served on `--metrics-port`.

The chart's alerts and Grafana dashboard query these names (a test checks each name they
use is one of `exported_names()`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("rlhf_operator_reconciles_total", "Reconciles of RLHFJobs, by trigger.", ["trigger"])
ERRORS = Counter("rlhf_operator_reconcile_errors_total", "Reconciles that raised, by exception type.", ["error"])
DURATION = Histogram("rlhf_operator_reconcile_duration_seconds", "Wall time of one reconcile.",
                     buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
RESTARTS = Counter("rlhf_operator_job_restarts_total", "Whole-job restarts started by the operator.")
JOBS = Gauge("rlhf_operator_jobs", "RLHFJobs by phase (updated on every resync).", ["phase"])
LEADER = Gauge("rlhf_operator_leader", "1 while this process holds the leader lease.")
JOB_INFO = Gauge("rlhf_operator_job_info", "1 for each RLHFJob, labelled with its phase (gone with the job).",
                 ["namespace", "rlhf_job", "phase"])
QUEUE_DEPTH = Gauge("rlhf_operator_workqueue_depth", "Jobs waiting in the work queue for a reconcile.")
QUEUE_WAIT = Histogram("rlhf_operator_workqueue_wait_seconds", "Time a job waited in the work queue before its reconcile.",
                       buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60))
CHILD_READS = Counter("rlhf_operator_child_reads_total",
                      "Reads of a job's children by a reconcile: from kopf's indexes, or from the API server (audits).",
                      ["source"])

PHASES = ("Pending", "Initializing", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
TRIGGERS = ("job", "pod", "resync")  # and each backend's workload (handlers.py)

# Series exist (at 0) from the start, so rates and "jobs by phase" have data before the first event.
for _trigger in TRIGGERS:
    RECONCILES.labels(trigger=_trigger)
for _phase in PHASES:
    JOBS.labels(phase=_phase)
for _source in ("index", "api"):
    CHILD_READS.labels(source=_source)


def exported_names() -> set[str]:
    """Every sample name the operator exports (counters with `_total`, histogram series)."""
    names = set()
    for metric in (RECONCILES, ERRORS, DURATION, RESTARTS, JOBS, LEADER, JOB_INFO, QUEUE_DEPTH, QUEUE_WAIT, CHILD_READS):
        for family in metric.describe():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
            if family.type == "histogram":
                names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
    return names


_JOB_LABELS: set[tuple[str, str, str]] = set()


def set_jobs_by_phase(phases: list[str], jobs: list[tuple[str, str, str]] | None = None) -> None:
    """The phase counts, and one `rlhf_operator_job_info` series per (namespace, name, phase)
    of `jobs`; the series of jobs gone (or gone from that phase) are removed."""
    for phase in PHASES:
        JOBS.labels(phase=phase).set(sum(p == phase for p in phases))
    if jobs is None:
        return
    current = set(jobs)
    for labels in _JOB_LABELS - current:
        JOB_INFO.remove(*labels)
    for labels in current:
        JOB_INFO.labels(*labels).set(1)
    _JOB_LABELS.clear()
    _JOB_LABELS.update(current)


def serve(port: int) -> None:
    if port:
        start_http_server(port)
