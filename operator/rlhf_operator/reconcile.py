"""The reconcile of one job: read the job and its children, plan (status.py), build
(builders/), apply (kube.py), patch the status, post events.

Level-based: every trigger (a watch event of the job, of one of its pods or of its
PyTorchJob, and a resync of every job) queues the job's key, and one reconcile
recomputes everything from what the API server holds. The queue (workqueue.py) never
runs one job twice at once. The decision is written to the status before any child is
deleted, and children have fixed names and are written with server-side apply, so
killing the operator at any point and starting it again neither loses a restart nor
duplicates a child.

Ownership before write (ownership.py): a child's name is read before the operator first
writes it (a GET, or the index's object); an object there that the job does not control is
left alone, and the job shows a `ChildConflict` condition and one Warning event instead.
Later applies and every delete name the uid of the object found, so an object replaced
under the same name is never changed or deleted. Left open: an object created by someone
else between that read and the operator's first write (the same instant) is taken over.

Children are read from kopf's indexes of the operator's watches (`index`), and from the
API server when there is no index (tests, tools) and once every AUDIT_SECONDS per job:
kopf's index keeps an object deleted while its watch was down and listed again (a 410
Gone), and such a pod would hold a restart for ever.

`JobCache` is the operator's only memory of a job, runtime-only and safe to lose:
everything that must survive a restart is in the job's status.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from pydantic import ValidationError

from rlhf_contract.api import problems
from rlhf_contract.api.models import RLHFJob
from rlhf_contract.backends import BACKENDS, ROLLOUT_NEEDS, missing_message
from rlhf_contract.redact import redact_text
from rlhf_contract.sources import plan as sources_plan

from kubernetes.client.rest import ApiException

from . import metrics, status
from .status import as_stored, status_view
from .conditions import (BACKEND_MISSING, CHILD_CONFLICT, CHILD_REFUSED, CONDITION_TYPES, conditions_by_type,
                         conflict_condition, missing_condition,
                         refused_condition)
from .backends import CHILD_KINDS, name_of, build_support, build_workloads, job_settings, workloads_of
from .builders import LABEL_JOB_UID, PodSettings, PodSettingsError
from .builders.meta import attempt_of
from .kube import Kube, not_ready, observed_of
from .ownership import conflict, controlled_by, earlier_job

log = logging.getLogger("rlhf_operator")

APPLY_CACHE_SECONDS = 60.0  # children are re-applied at least this often (repairs manual edits)
AUDIT_SECONDS = 300.0  # a job's children are read from the API server, not the indexes, this often
JobKey = tuple[str, str]  # (namespace, name)
REFUSED, CONFLICT, EARLIER, MISSING = "refused", "conflict", "earlier", "missing"  # why a child was not written
WORKLOAD_NAMES = {ck.kind: ck.name for ck in CHILD_KINDS if ck.name is not None}  # kind -> name(job)


@dataclass(frozen=True)
class Written:
    """One child as the operator last left it."""

    digest: str  # of the manifest last applied (or not written)
    when: float  # time.monotonic()
    uid: str | None = None
    """The object's uid, once written or found the job's: later applies name it."""
    problem: tuple[str, str] | None = None
    """Why it is not written: (REFUSED, the API server's message), (CONFLICT, whose it is)
    or (EARLIER, ...: an earlier job's, being garbage-collected)."""


@dataclass
class JobCache:
    """What the operator remembers of one job between reconciles. Losing it costs a few
    redundant applies and, at worst, a failed pod's exit code that the pod's deletion
    took away (the PyTorchJob's Failed condition still restarts the job)."""

    uid: str | None = None
    applied: dict[tuple[str, str], Written] = field(default_factory=dict)
    """(kind, name) -> what was last done with it."""
    failed_pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # written by the watch thread: iterate a copy
    """Failed pods seen in watch events, by uid: the training-operator and the StatefulSet
    controller delete failed pods within milliseconds, so a LIST may no longer show them."""
    audited: float = field(default_factory=time.monotonic)
    """When the job's children were last read from the API server (a new job's index is exact)."""
    output_claim: tuple[str, bool] | None = None
    """(output.claimName, whether it is ReadWriteMany), read once: a claim's accessModes never change."""


class JobCaches:
    """One `JobCache` per job key, dropped when the job is gone."""

    def __init__(self) -> None:
        self._caches: dict[JobKey, JobCache] = {}
        self._guard = threading.Lock()

    def get(self, key: JobKey) -> JobCache:
        with self._guard:
            return self._caches.setdefault(key, JobCache())

    def drop(self, key: JobKey) -> None:
        with self._guard:
            self._caches.pop(key, None)

    def __len__(self) -> int:
        with self._guard:
            return len(self._caches)

    def __contains__(self, key: JobKey) -> bool:
        with self._guard:
            return key in self._caches


def job_model(body: dict[str, Any]) -> RLHFJob:
    meta = body["metadata"]
    return RLHFJob.model_validate({
        "apiVersion": body["apiVersion"], "kind": body["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"],
                     "labels": meta.get("labels") or {}, "annotations": meta.get("annotations") or {}},
        "spec": body.get("spec") or {},
    })


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _server_message(err: ApiException) -> str:
    """The Status message of an API error (what `kubectl apply` would print)."""
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{err.status} {err.reason}: {err.body or ''}".strip()


def _job(obj: dict[str, Any]) -> str:
    """The name of the job a child manifest is built for."""
    return obj["metadata"]["ownerReferences"][0]["name"]


class Reconciler:
    def __init__(self, kube: Kube, node_lost_after: timedelta = status.NODE_LOST_AFTER,
                 index: Callable[[JobKey], tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]] | None = None,
                 allow_host_path: bool = False):
        """`index`: a job's children in kopf's indexes, by plural, and the nodes of its pods,
        by name (handlers.read_indexes). `allow_host_path`: jobs may mount hostPath volumes
        (the chart's `security.allowHostPath`; builders/pods.py refuses them otherwise)."""
        self.kube = kube
        self.allow_host_path = allow_host_path
        self.caches = JobCaches()
        self.node_lost_after = node_lost_after
        self.index = index

    def observe(self, cache: JobCache, namespace: str, name: str, backend: str) -> status.Observed:
        now = time.monotonic()
        if self.index is None or now - cache.audited >= AUDIT_SECONDS:
            cache.audited = now
            metrics.CHILD_READS.labels(source="api").inc()
            return self.kube.observe(namespace, name, backend)
        metrics.CHILD_READS.labels(source="index").inc()
        indexed, nodes = self.index((namespace, name))
        observed = observed_of(namespace, name, backend, lambda ck: indexed.get(ck.plural, []),
                               lambda names: not_ready(names, nodes.get))
        return self.kube.with_adopted(observed, namespace, name, backend)  # backend TrainJob: its unlabelled pods

    def note_pod(self, key: JobKey, pod: dict[str, Any]) -> bool:
        """Remember a pod from a watch event when it shows a failure; True if it does."""
        if status.pod_failure(pod) is None:
            return False
        self.caches.get(key).failed_pods[pod["metadata"]["uid"]] = pod
        return True

    def forget(self, key: JobKey) -> None:
        self.caches.drop(key)

    def __call__(self, key: JobKey, trigger: str) -> str | None:
        metrics.RECONCILES.labels(trigger=trigger).inc()
        with metrics.DURATION.time():
            try:
                return self.reconcile(*key)
            except Exception as err:
                metrics.ERRORS.labels(error=type(err).__name__).inc()
                raise

    def _apply(self, cache: JobCache, obj: dict[str, Any], seen: dict[str, Any] | None = None,
               force: bool = False, again: bool = True) -> Written:
        """Apply `obj` unless applied within APPLY_CACHE_SECONDS as it is (`force`: its
        workload is missing). Its name is read first unless known to hold the job's object
        (`seen`: the object observed, else a GET); an object there that the job does not
        control is not written (a problem, remembered as a refusal is)."""
        key, name = (obj["kind"], obj["metadata"]["name"]), obj["metadata"]["name"]
        digest, now = _digest(obj), time.monotonic()
        old = cache.applied.get(key)
        missing = old is not None and old.problem is not None and old.problem[0] == MISSING
        if (not force or missing) and old and old.digest == digest and now - old.when < APPLY_CACHE_SECONDS:
            return old  # a missing CRD too: asked again once a minute, not on every reconcile
        uid = old.uid if old and not force else None
        if uid is None and (existing := seen or self.kube.get(obj)) is not None:
            if not controlled_by(existing, cache.uid):
                earlier = earlier_job(existing, _job(obj))
                out = Written(digest, now, problem=(EARLIER, "") if earlier else (CONFLICT, conflict(existing, _job(obj))))
                if not earlier:  # an earlier job's: read again next time (the garbage collector is at it)
                    cache.applied[key] = out
                return out
            uid = existing["metadata"]["uid"]
        try:
            written = self.kube.apply(obj, uid)
        except ApiException as err:
            if uid and again and (err.status == 409 or (err.status == 422 and "metadata.uid" in (err.body or ""))):
                cache.applied.pop(key, None)  # deleted or replaced since: whose is the name now?
                return self._apply(cache, obj, force=True, again=False)
            if err.status == 404 and (obj["kind"] in BACKENDS or obj["kind"] in ROLLOUT_NEEDS):  # its CRD is missing
                out = Written(digest, now, problem=(MISSING, missing_message(obj["kind"])))
                cache.applied[key] = out
                return out
            if err.status != 422:
                raise
            out = Written(digest, now, problem=(REFUSED, redact_text(
                f"{obj['kind']} {name} refused by the API server: {_server_message(err)}")))
            cache.applied[key] = out
            return out
        cache.applied[key] = Written(digest, now, uid=written["metadata"]["uid"])
        return cache.applied[key]

    def _apply_all(self, cache: JobCache, objs: list[dict[str, Any]], observed: status.Observed) -> dict[str, str]:
        """Apply `objs` in order, stopping at the first not written: {REFUSED: the API
        server's message} for one it refuses as invalid (422), {CONFLICT: ...} for one of
        another owner, {} for all written or an earlier job's still there (nothing after it is
        written: the RoleBinding must not bind the job's Role to a ServiceAccount not the job's)."""
        workloads = workloads_of(observed)
        for obj in objs:
            # the job's workload of its kind (not the judge's or sandbox's StatefulSet): observed, or missing
            workload = obj["metadata"]["name"] == WORKLOAD_NAMES.get(obj["kind"], lambda _: None)(_job(obj))
            seen = workloads.get(obj["kind"]) if workload else None
            written = self._apply(cache, obj, seen, force=workload and seen is None)
            if written.problem is not None:
                return {written.problem[0]: written.problem[1]} if written.problem[0] != EARLIER else {}
        return {}

    def _delete_workloads(self, cache: JobCache, job_name: str, kinds: list[str], observed: status.Observed) -> list[str]:
        """Delete the workloads of `kinds` that the job controls, each by its uid; the others
        are left alone: the conflicts among them (not an earlier job's)."""
        conflicts, workloads = [], workloads_of(observed)
        for kind in kinds:
            obj = workloads.get(kind)
            if obj is None:
                continue
            meta = obj["metadata"]
            if controlled_by(obj, cache.uid):
                self.kube.delete(kind, meta["namespace"], meta["name"], meta["uid"])
            elif not earlier_job(obj, job_name):
                conflicts.append(conflict(obj, job_name))
        return conflicts

    def _report(self, body: dict[str, Any], plan_status: dict[str, Any], outcome: dict[str, str]) -> None:
        """The `ChildRefused` and `ChildConflict` conditions (and a Warning event when one turns
        True or its message changes) from the outcome of the apply."""
        conds, now, generation = conditions_by_type(plan_status), datetime.now(timezone.utc), body["metadata"].get("generation")
        changed = [type_ for type_, problem, set_condition in (
            (CHILD_REFUSED, outcome.get(REFUSED), refused_condition),
            (CHILD_CONFLICT, outcome.get(CONFLICT), conflict_condition),
            (BACKEND_MISSING, outcome.get(MISSING), missing_condition)) if set_condition(conds, problem, now, generation)]
        if not changed:
            return
        plan_status["conditions"] = [conds[t] for t in CONDITION_TYPES if t in conds]
        if problem := outcome.get(CONFLICT) or outcome.get(REFUSED) or outcome.get(MISSING):
            plan_status["message"] = problem
        meta = body["metadata"]
        self.kube.patch_status(meta["namespace"], meta["name"], status_view(plan_status))
        for type_ in changed:
            if conds[type_]["status"] == "True":
                metrics.ERRORS.labels(error=type_).inc()
                self.kube.event(body, "Warning", type_, conds[type_]["message"])
                log.warning("%s/%s: %s", meta["namespace"], meta["name"], conds[type_]["message"])

    def _output_access(self, cache: JobCache, job: RLHFJob, settings: PodSettings, namespace: str) -> PodSettings:
        """`settings` with `output_shared` when the job's rollout pods download its model and its
        output claim is ReadWriteMany (builders/storage.py: they then mount the claim and read
        the trainer's copy). A claim not there yet is asked again next time; one the operator
        may not read (a chart without the rule) counts as not shared: the emptyDir fallback."""
        claim = settings.output_claim
        if not claim or job.spec.trainer_pods_only or not sources_plan(job, settings.output_dir, model_only=True):
            return settings
        if cache.output_claim is None or cache.output_claim[0] != claim:
            try:
                modes = self.kube.claim_access_modes(namespace, claim)
            except ApiException as err:
                if err.status != 403:
                    raise
                log.warning("%s: cannot read the PersistentVolumeClaim %s (%s): its rollout pods download into an "
                            "emptyDir", job.metadata.name, claim, err.reason)
                modes = []
            if modes is None:
                return settings
            cache.output_claim = (claim, "ReadWriteMany" in modes)
        return replace(settings, output_shared=cache.output_claim[1])

    def reconcile(self, namespace: str, name: str) -> str | None:
        """Bring one job's children and status in line with its spec; returns the phase."""
        kube, key = self.kube, (namespace, name)
        body = kube.get_job(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(key)
            return None
        cache = self.caches.get(key)
        if cache.uid != body["metadata"]["uid"]:  # a new job of the same name
            seen = {u: p for u, p in list(cache.failed_pods.items())
                    if (p["metadata"].get("labels") or {}).get(LABEL_JOB_UID) == body["metadata"]["uid"]}
            cache.uid, cache.applied, cache.failed_pods = body["metadata"]["uid"], {}, seen
        backend = name_of(body)
        observed = self.observe(cache, namespace, name, backend)
        attempt = int((body.get("status") or {}).get("restarts") or 0)
        for uid, p in list(cache.failed_pods.items()):
            if (attempt_of(p) or 0) < attempt:
                cache.failed_pods.pop(uid, None)  # evidence of an earlier attempt is no longer needed
        listed = {p["metadata"].get("uid") for p in observed.pods}
        observed.pods += [p for u, p in list(cache.failed_pods.items()) if u not in listed]

        job, invalid, settings = None, None, PodSettings()
        try:
            job = job_model(body)
            settings = job_settings(job, allow_host_path=self.allow_host_path)  # PodSettings and the backend's limits
        except ValidationError as err:
            job, invalid = None, "; ".join(str(p) for p in problems(err))
        except PodSettingsError as err:
            job, invalid = None, str(err)
        if job is not None:
            settings = self._output_access(cache, job, settings, namespace)

        plan = status.plan(body, job, observed, datetime.now(timezone.utc), invalid=invalid,
                           node_lost_after=self.node_lost_after)
        old = body.get("status") or {}
        conds = conditions_by_type(plan.status)
        blocked = next((c for t in (CHILD_CONFLICT, CHILD_REFUSED, BACKEND_MISSING) if (c := conds.get(t, {})).get("status") == "True"), None)
        if blocked and plan.status["phase"] not in status.TERMINAL:  # still why nothing runs, until the children are written
            plan.status["message"] = blocked["message"]
        # 1. The decision first: a restart or a terminal phase is durable before anything is deleted.
        if as_stored(status_view(plan.status)) != as_stored(status_view(old)):
            kube.patch_status(namespace, name, status_view(plan.status))
            if plan.status["restarts"] > int(old.get("restarts") or 0):
                metrics.RESTARTS.inc()
            for ev in plan.events:
                kube.event(body, ev.type, ev.reason, ev.message)
            log.info("%s/%s: %s (%s)", namespace, name, plan.status["phase"],
                     redact_text(plan.events[0].message if plan.events else ""))
        # 2. Stop what must stop (what the job controls); pods of lost nodes go at once.
        in_the_way = self._delete_workloads(cache, name, plan.delete, observed)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in observed.pods}
        for pod in plan.force_delete:
            log.warning("%s/%s: force-deleting pod %s (its node is lost)", namespace, name, pod)
            kube.force_delete_pod(namespace, pod, uids[pod])
        # 3. Create or update what must run; a child refused or in conflict stops the rest.
        if job is not None and (plan.apply_support or plan.create_workloads):
            wanted = [*(build_support(job, settings) if plan.apply_support else []),
                      *(build_workloads(job, plan.status["restarts"], settings) if plan.create_workloads else [])]
            outcome = self._apply_all(cache, wanted, observed)
            if in_the_way:
                outcome[CONFLICT] = "; ".join([*in_the_way, *filter(None, [outcome.get(CONFLICT)])])
            self._report(body, plan.status, outcome)
        if plan.delete_job:
            log.info("%s/%s: ttlSecondsAfterFinished passed, deleting the job", namespace, name)
            kube.delete_job(namespace, name, body["metadata"]["uid"])
        return plan.status["phase"]
