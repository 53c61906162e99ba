"""kopf wiring only: the watches put job keys into the work queue; reconcile.py does the
rest. Only the holder of the Lease runs kopf at all.

Watches: RLHFJobs; the children of `backends.CHILD_KINDS` (pods, the rollout StatefulSets,
each backend's workload; a TrainJob's pods once its backend has labelled them) that carry the job label, filtered by the API server
(`settings.watching.label_selectors`), so the operator never receives the cluster's
other pods. Each child watch fills a kopf index (`@kopf.index`: job key -> its objects of
that kind), from which reconciles read the children: no GET or LIST per reconcile. kopf
runs no handler before every indexed watch has listed and indexed what exists, and the
reconcile workers start from the first handler, so no reconcile sees an index not yet
filled (a restarted operator would otherwise find no children and create them again).
Nodes: one watch (every node's Ready condition, indexed by name) serves the lost-node
check of every job. A resync thread queues every job every `resync_seconds` (deadlines,
TTLs, missed events).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import kopf

from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL
from rlhf_contract.exit_codes import ExitCode

from . import health, metrics
from .health import Heartbeat
from .backends import BACKENDS, CHILD_KINDS, ChildKind
from .builders import LABEL_JOB
from .kube import Kube, node_readiness
from .leader import Lease
from .reconcile import Reconciler
from .status import NODE_LOST_AFTER
from .workqueue import WorkQueue

log = logging.getLogger("rlhf_operator")


@dataclass
class _State:
    heartbeat: Heartbeat = Heartbeat()
    reconciler: Reconciler | None = None
    queue: WorkQueue | None = None
    resync_seconds: float = 15.0
    loop: asyncio.AbstractEventLoop | None = None
    indexes: dict[str, Any] | None = None  # plural -> kopf's index of that child kind
    nodes: Any = None  # kopf's index of the nodes' readiness, by name
    reconciling: bool = False


STATE = _State()
# A reconcile that several events asked for is counted under the most specific of them.
TRIGGER_PRIORITY = {"resync": 0, "job": 1, **{b.trigger: 2 for b in BACKENDS.values()}, "pod": 3}


def _enqueue(namespace: str, name: str, trigger: str, urgent: bool = False) -> None:
    assert STATE.queue is not None, "operator not started"
    STATE.queue.add((namespace, name), trigger, urgent=urgent)


def _from_kopf(namespace: str, name: str, trigger: str, urgent: bool = False) -> None:
    """`_enqueue` from a kopf handler. kopf (1.45) runs none before every indexed watch has
    listed its kind and indexed each object listed: the first starts the reconciles."""
    if not STATE.reconciling:  # handlers run on kopf's one event loop: no race here
        STATE.reconciling = True
        STATE.queue.start()
        log.info("indexes filled: reconciling")
    _enqueue(namespace, name, trigger, urgent)


def _index_name(ck: ChildKind) -> str:
    return f"{ck.plural}_by_job"


def _by_job(namespace: str, labels: dict[str, str], body: kopf.Body, **_: Any) -> dict[tuple[str, str], Any]:
    """An index entry: the child (a plain copy, without managedFields) under its job's key."""
    obj = json.loads(json.dumps(dict(body)))
    obj["metadata"].pop("managedFields", None)
    return {(namespace, labels[LABEL_JOB]): obj}


for _ck in CHILD_KINDS:  # on a cluster without the kind's CRD kopf watches nothing and the index stays empty
    kopf.index(_ck.group, _ck.version, _ck.plural, labels={LABEL_JOB: kopf.PRESENT}, id=_index_name(_ck))(_by_job)


@kopf.index("", "v1", "nodes")
def nodes_by_name(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    """Every node's Ready condition (lost nodes), by name: one watch instead of a GET of each
    node of each job's pods."""
    return {name: node_readiness(body)}


@kopf.on.startup()
async def _keep_indexes(nodes_by_name: kopf.Index, **kwargs: Any) -> None:
    """The indexes (kopf passes them to every handler) and the loop that writes them."""
    STATE.loop = asyncio.get_running_loop()
    STATE.indexes = {ck.plural: kwargs[_index_name(ck)] for ck in CHILD_KINDS}
    STATE.nodes = nodes_by_name


def read_indexes(key: tuple[str, str]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """A job's children in every index (plural -> objects) and the nodes of its pods (name ->
    node, absent when gone), read on kopf's event loop, which alone writes the indexes: one
    consistent snapshot, taken from a reconcile worker."""
    assert STATE.loop is not None and STATE.indexes is not None, "kopf not started"
    indexes, nodes, done = STATE.indexes, STATE.nodes, concurrent.futures.Future()

    def snapshot() -> None:
        try:
            children = {plural: list(index.get(key, ())) for plural, index in indexes.items()}
            names = {n for p in children.get("pods", ()) if (n := (p.get("spec") or {}).get("nodeName"))}
            done.set_result((children, {n: next(iter(nodes[n])) for n in names if n in nodes}))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting worker
            done.set_exception(err)

    STATE.loop.call_soon_threadsafe(snapshot)
    return done.result(timeout=30)


@kopf.on.startup()
async def _beat_from_kopfs_loop(**_: Any) -> None:
    """The leader's liveness: a beat every few seconds from kopf's event loop itself."""
    async def beat() -> None:
        while True:
            STATE.heartbeat.beat("leading (kopf's event loop)")
            await asyncio.sleep(health.BEAT_S)

    STATE.beat_task = asyncio.get_running_loop().create_task(beat())


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False  # our events are our own (kube.event), not kopf's log lines
    settings.watching.connect_timeout = 10
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.networking.request_timeout = 30
    # Server-side filtering: only the job's own children reach us.
    for ck in CHILD_KINDS:
        settings.watching.label_selectors[ck.api_version, ck.plural] = LABEL_JOB


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
async def on_job(event: dict[str, Any], namespace: str, name: str, **_: Any) -> None:
    if event.get("type") == "DELETED":
        STATE.reconciler.forget((namespace, name))
    else:
        _from_kopf(namespace, name, "job")


@kopf.on.event("", "v1", "pods", labels={LABEL_JOB: kopf.PRESENT})
async def on_pod(event: dict[str, Any], body: kopf.Body, namespace: str, labels: dict[str, str], **_: Any) -> None:
    key = (namespace, labels[LABEL_JOB])
    pod = json.loads(json.dumps(dict(body)))
    log.debug("pod %s %s: %s", event.get("type"), pod["metadata"]["name"], (pod.get("status") or {}).get("phase"))
    failed = STATE.reconciler.note_pod(key, pod)
    _from_kopf(*key, "pod", urgent=failed)


def _on_workload(trigger: str):
    async def on_workload(namespace: str, labels: dict[str, str], **_: Any) -> None:
        _from_kopf(namespace, labels[LABEL_JOB], trigger)
    on_workload.__name__ = f"on_{trigger}"
    return on_workload


# Each backend's workload (backends/). On a cluster without the backend's CRD kopf finds no
# such resource and watches nothing (jobs with that backend then show BackendMissing).
for _b in BACKENDS.values():
    metrics.RECONCILES.labels(trigger=_b.trigger)  # its series exists (at 0) from the start
    kopf.on.event(_b.workload.group, _b.workload.version, _b.workload.plural, labels={LABEL_JOB: kopf.PRESENT},
                  id=f"on_{_b.trigger}")(_on_workload(_b.trigger))


def _resync_loop(namespaces: list[str], stop: threading.Event) -> None:
    """The timer: every job is queued every `resync_seconds`; the phase gauge counts them."""
    while not stop.wait(STATE.resync_seconds):
        phases, jobs_seen, listed_all = [], [], True
        for ns in namespaces or [None]:
            try:
                jobs = STATE.reconciler.kube.list_jobs(ns)
            except Exception as err:  # noqa: BLE001 - the next round retries
                log.warning("resync: cannot list jobs: %s", err)
                listed_all = False
                continue
            for j in jobs:
                _enqueue(j["metadata"]["namespace"], j["metadata"]["name"], "resync")
                if phase := (j.get("status") or {}).get("phase"):
                    phases.append(phase)
                    jobs_seen.append((j["metadata"]["namespace"], j["metadata"]["name"], phase))
        # a failed listing keeps the per-job series it cannot confirm (no alert flaps)
        metrics.set_jobs_by_phase(phases, jobs_seen if listed_all else None)


def allow_host_path() -> bool:
    """$RLHF_ALLOW_HOST_PATH: `1` or `true` (what the chart's `security.allowHostPath` sets)."""
    return os.environ.get("RLHF_ALLOW_HOST_PATH", "").strip().lower() in ("1", "true")


class JsonFormatter(logging.Formatter):
    """One JSON object per line (`logFormat: json`): time (UTC, RFC 3339), level, logger,
    message, and the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def run(namespaces: list[str], *, metrics_port: int = 8080, lease_namespace: str | None = None,
        lease_name: str = "rlhf-operator", lease_duration: int = 15, resync_seconds: float = 15.0, verbose: bool = False, workers: int | None = None,
        node_lost_seconds: float | None = None, log_format: str = "text", health_port: int = 0) -> int:
    """`rlhfctl operator`: wait for the leader lease, then run kopf until stopped.
    `node_lost_seconds` (default $RLHF_OPERATOR_NODE_LOST_SECONDS or 60): how long a node
    may be not Ready before its pods count as failed and are force-deleted. `workers`
    (default $RLHF_OPERATOR_WORKERS or 16): reconciles run at once, on different jobs.
    $RLHF_ALLOW_HOST_PATH=1 (the chart's `security.allowHostPath`): jobs may mount hostPath volumes."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler], force=True)
    logging.getLogger("kopf").setLevel(logging.INFO if verbose else logging.WARNING)
    if node_lost_seconds is None:
        env = os.environ.get("RLHF_OPERATOR_NODE_LOST_SECONDS")
        node_lost_seconds = float(env) if env else NODE_LOST_AFTER.total_seconds()
    workers = workers or int(os.environ.get("RLHF_OPERATOR_WORKERS") or 16)
    kube = Kube(connections=workers + 4)
    STATE.reconciler = Reconciler(kube, node_lost_after=timedelta(seconds=node_lost_seconds), index=read_indexes,
                                  allow_host_path=allow_host_path())
    STATE.queue = WorkQueue(STATE.reconciler, workers=workers, priority=TRIGGER_PRIORITY.__getitem__,
                            on_depth=metrics.QUEUE_DEPTH.set, on_wait=metrics.QUEUE_WAIT.observe)
    STATE.resync_seconds = resync_seconds
    lease_ns = lease_namespace or os.environ.get("POD_NAMESPACE") or (namespaces[0] if namespaces else "default")
    lease = Lease(kube, lease_ns, name=lease_name, duration=lease_duration)
    # Every replica serves metrics (rlhf_operator_leader 0 while standing by) and its probes.
    metrics.LEADER.set(0)
    metrics.serve(metrics_port)
    health.serve(health_port, STATE.heartbeat)
    log.info("waiting for lease %s/%s as %s", lease_ns, lease.name, lease.identity)
    while True:
        STATE.heartbeat.beat("waiting for the leader lease")
        try:
            if lease.try_acquire():
                break
        except Exception as err:  # noqa: BLE001 - the API server may be briefly unreachable
            log.warning("trying the lease: %s", err)
        time.sleep(1)
    log.info("leader: acquired lease %s/%s", lease_ns, lease.name)
    metrics.LEADER.set(1)

    stop = threading.Event()

    def lost() -> None:
        log.error("lost the leader lease; exiting so that only one operator acts")
        os._exit(ExitCode.FAILED)

    threading.Thread(target=lease.hold, args=(stop, lost), daemon=True, name="lease").start()
    threading.Thread(target=_resync_loop, args=(namespaces, stop), daemon=True, name="resync").start()
    try:
        # Our lease identity for kopf too: its own default asks the passwd database for the
        # user name, and the operator's uid (65532) has no entry in most images (a KeyError
        # in the first real pod that ran it).
        kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces, identity=lease.identity)
    finally:
        stop.set()
        STATE.queue.stop()
        metrics.LEADER.set(0)
        lease.release()
    return 0
