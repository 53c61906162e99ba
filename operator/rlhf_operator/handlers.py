"""Thin kopf handlers: read the job and its children, plan (status.py), build
(builders/), apply (kube.py), patch the status, post events.

Level-based: every trigger (a watch event of the job, of one of its pods or of its
PyTorchJob, and a resync of every job every `resync_seconds`) runs the same `reconcile`,
which recomputes everything from what the API server holds. A per-job lock keeps two
triggers of one job from interleaving. The decision is written to the status before any
child is deleted, and children have fixed names and are written with server-side apply,
so killing the operator at any point and starting it again neither loses a restart nor
duplicates a child. Only the holder of the Lease runs kopf at all.

Simplification: kopf watches every pod (client-side label filtering); `--namespace`
narrows the watches on large clusters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import kopf
from pydantic import ValidationError

from . import metrics, status
from rlhf_contract.api.load import _problems
from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL, RLHFJob
from .builders import (
    LABEL_JOB, PodSettings, PodSettingsError, build_support, build_workloads, rollout_name, trainer_name,
)
from .kube import Kube, Lease

log = logging.getLogger("rlhf_operator")

APPLY_CACHE_SECONDS = 60.0  # children are re-applied at least this often (repairs manual edits)


@dataclass
class _State:
    kube: Kube | None = None
    resync_seconds: float = 15.0


STATE = _State()
_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_applied: dict[tuple[str, str, str], tuple[str, float]] = {}
# Failed pods seen in watch events, by job: the training-operator and the StatefulSet
# controller delete failed pods within milliseconds, so a LIST may no longer show them.
_failed_pods: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}


def _lock(key: tuple[str, str]) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _job_model(body: dict[str, Any]) -> RLHFJob:
    meta = body["metadata"]
    return RLHFJob.model_validate({
        "apiVersion": body["apiVersion"], "kind": body["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                     "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
        "spec": body.get("spec") or {},
    })


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _apply(kube: Kube, obj: dict[str, Any], force: bool = False) -> None:
    meta = obj["metadata"]
    key = (meta["ownerReferences"][0]["uid"], obj["kind"], meta["name"])
    digest, now = _digest(obj), time.monotonic()
    cached = _applied.get(key)
    if not force and cached and cached[0] == digest and now - cached[1] < APPLY_CACHE_SECONDS:
        return
    kube.apply(obj)
    _applied[key] = (digest, now)


def _status_view(st: dict[str, Any]) -> dict[str, Any]:
    """The part of the status the operator owns (the trainer owns progress, but totalSteps)."""
    view = {k: v for k, v in st.items() if k != "progress"}
    view["progress"] = {"totalSteps": (st.get("progress") or {}).get("totalSteps")}
    return view


def reconcile(namespace: str, name: str, trigger: str, hint_pod: dict[str, Any] | None = None) -> str | None:
    """Bring one job's children and status in line with its spec; returns the phase.
    `hint_pod`: the pod of a watch event, remembered when it shows a failure."""
    kube = STATE.kube
    assert kube is not None, "operator not started"
    if hint_pod is not None and status.pod_failure(hint_pod):
        _failed_pods.setdefault((namespace, name), {})[hint_pod["metadata"]["uid"]] = hint_pod
    metrics.RECONCILES.labels(trigger=trigger).inc()
    with _lock((namespace, name)), metrics.DURATION.time():
        try:
            return _reconcile(kube, namespace, name)
        except Exception as err:
            metrics.ERRORS.labels(error=type(err).__name__).inc()
            raise


def _reconcile(kube: Kube, namespace: str, name: str) -> str | None:
    body = kube.get_job(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        _failed_pods.pop((namespace, name), None)
        return None
    observed = kube.observe(namespace, name)
    seen = _failed_pods.get((namespace, name), {})
    attempt = str((body.get("status") or {}).get("restarts") or 0)
    for uid in [u for u, p in list(seen.items()) if p["metadata"]["labels"].get("rlhf.dev/attempt") != attempt]:
        seen.pop(uid, None)  # evidence of an earlier attempt is no longer needed
    listed = {p["metadata"].get("uid") for p in observed.pods}
    observed.pods += [p for u, p in list(seen.items()) if u not in listed]

    job, invalid, settings = None, None, PodSettings()
    try:
        job = _job_model(body)
        settings = PodSettings.from_job(job)
    except ValidationError as err:
        job, invalid = None, "; ".join(str(p) for p in _problems(err))
    except PodSettingsError as err:
        job, invalid = None, str(err)

    plan = status.plan(body, job, observed, datetime.now(timezone.utc), invalid=invalid)
    old = body.get("status") or {}
    # 1. The decision first: a restart or a terminal phase is durable before anything is deleted.
    if _status_view(plan.status) != _status_view(old):
        kube.patch_status(namespace, name, _status_view(plan.status))
        if plan.status["restarts"] > int(old.get("restarts") or 0):
            metrics.RESTARTS.inc()
        for ev in plan.events:
            kube.event(body, ev.type, ev.reason, ev.message)
        log.info("%s/%s: %s (%s)", namespace, name, plan.status["phase"],
                 (plan.events[0].message if plan.events else ""))
    # 2. Stop what must stop.
    for kind in plan.delete:
        kube.delete(kind, namespace, rollout_name(name) if kind == "StatefulSet" else trainer_name(name))
    # 3. Create or update what must run.
    if job is not None and plan.apply_support:
        for obj in build_support(job):
            _apply(kube, obj)
    if job is not None and plan.create_workloads:
        missing = {"StatefulSet": observed.statefulset is None, "PyTorchJob": observed.pytorchjob is None}
        for obj in build_workloads(job, plan.status["restarts"], settings):
            _apply(kube, obj, force=missing[obj["kind"]])
    if plan.delete_job:
        log.info("%s/%s: ttlSecondsAfterFinished passed, deleting the job", namespace, name)
        kube.delete_job(namespace, name)
    return plan.status["phase"]


# ---------------------------------------------------------------- kopf wiring


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False  # our events are our own (kube.event), not kopf's log lines
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = 30
    settings.execution.max_workers = 8


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def on_job(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
    if event.get("type") != "DELETED":
        reconcile(namespace, name, "job")


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
def on_pod(event: dict[str, Any], body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> None:
    pod = json.loads(json.dumps(dict(body)))
    log.debug("pod %s %s: %s", event.get("type"), pod["metadata"]["name"], (pod.get("status") or {}).get("phase"))
    reconcile(namespace, labels[LABEL_JOB], "pod", hint_pod=pod)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={LABEL_JOB: kopf.PRESENT})
def on_pytorchjob(namespace: str, labels: dict[str, str], **_: Any) -> None:
    reconcile(namespace, labels[LABEL_JOB], "pytorchjob")


def _resync_loop(namespaces: list[str], stop: threading.Event) -> None:
    """The timer: every job is reconciled every `resync_seconds` (deadlines, TTLs, missed events)."""
    while not stop.wait(STATE.resync_seconds):
        phases = []
        for ns in namespaces or [None]:
            try:
                jobs = STATE.kube.list_jobs(ns)
            except Exception as err:  # noqa: BLE001 - the next round retries
                log.warning("resync: cannot list jobs: %s", err)
                continue
            for j in jobs:
                try:
                    phase = reconcile(j["metadata"]["namespace"], j["metadata"]["name"], "resync")
                except Exception as err:  # noqa: BLE001
                    log.warning("resync of %s failed: %s", j["metadata"]["name"], err)
                    phase = (j.get("status") or {}).get("phase")
                if phase:
                    phases.append(phase)
        metrics.set_jobs_by_phase(phases)


def run(namespaces: list[str], *, metrics_port: int = 8080, lease_namespace: str | None = None,
        lease_duration: int = 15, resync_seconds: float = 15.0, verbose: bool = False) -> int:
    """`rlhfctl operator`: wait for the leader lease, then run kopf until stopped."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf").setLevel(logging.INFO if verbose else logging.WARNING)
    STATE.kube = Kube()
    STATE.resync_seconds = resync_seconds
    lease_ns = lease_namespace or os.environ.get("POD_NAMESPACE") or (namespaces[0] if namespaces else "default")
    lease = Lease(STATE.kube, lease_ns, duration=lease_duration)
    log.info("waiting for lease %s/%s as %s", lease_ns, lease.name, lease.identity)
    while not lease.try_acquire():
        time.sleep(1)
    log.info("leader: acquired lease %s/%s", lease_ns, lease.name)
    metrics.LEADER.set(1)
    metrics.serve(metrics_port)

    stop = threading.Event()

    def lost() -> None:
        log.error("lost the leader lease; exiting so that only one operator acts")
        os._exit(1)

    threading.Thread(target=lease.hold, args=(stop, lost), daemon=True, name="lease").start()
    threading.Thread(target=_resync_loop, args=(namespaces, stop), daemon=True, name="resync").start()
    try:
        kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces)
    finally:
        stop.set()
        metrics.LEADER.set(0)
        lease.release()
    return 0
