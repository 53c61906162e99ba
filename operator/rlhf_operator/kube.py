"""The only module that talks to the API server (besides kopf's own watches).

Children are written with server-side apply (field manager `rlhf-operator`, forced), so
applying the same manifest twice, or from two operator processes, never makes two
objects. An apply that names the object's uid (reconcile.py does, once it has read the
object and found it the job's) changes that object or nothing: the API server refuses it
when the object was replaced (422) or deleted (409). Deletes carry the uid as a
precondition, so a same-named object created since is never deleted. Every request has a timeout. The leader election that keeps two operator
replicas from acting at once is leader.py (over `Kube.request`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL
from rlhf_contract.redact import redact_text
from .backends import CHILD_KINDS, ChildKind, Observed, adopt, kinds_of
from .builders.meta import LABEL_JOB

log = logging.getLogger(__name__)

FIELD_MANAGER = "rlhf-operator"
TIMEOUT = (5, 30)  # connect, read seconds for every request
NODE_CACHE_SECONDS = 10.0  # a node read serves every job on it this long (lost-node grace: 60 s)

_PLURALS = {
    "ConfigMap": "configmaps", "Service": "services", "ServiceAccount": "serviceaccounts", "Pod": "pods",
    "Event": "events", "StatefulSet": "statefulsets", "NetworkPolicy": "networkpolicies", "Role": "roles",
    "RoleBinding": "rolebindings", "RLHFJob": PLURAL, "Lease": "leases", "Node": "nodes",
    **{ck.kind: ck.plural for ck in CHILD_KINDS},
}
_API_VERSIONS = {"StatefulSet": "apps/v1", "RLHFJob": f"{API_GROUP}/{API_VERSION}", "Lease": "coordination.k8s.io/v1",
                 **{ck.kind: ck.api_version for ck in CHILD_KINDS}}


def observed_of(namespace: str, name: str, backend: str, read: Callable[[ChildKind], list[dict[str, Any]]],
                nodes_not_ready: Callable[[set[str]], dict[str, datetime]]) -> Observed:
    """The job's children from `read(kind)` (the objects of that kind with the job's label,
    or the one of its name): for each workload kind of `backend` (its `kinds`), the object
    of the child's name (the newest, should a stale one linger); every pod of the job."""
    found: dict[str, Any] = {}
    for ck in kinds_of(backend):  # the pods, the backend's workloads
        objs = read(ck)
        if ck.name is None:
            found[ck.field] = objs
        else:
            named = [o for o in objs if o["metadata"]["name"] == ck.name(name)]
            found[ck.field] = max(named, key=lambda o: o["metadata"].get("creationTimestamp") or "", default=None)
    pods = found.get("pods") or []
    nodes = {n for p in pods if (n := (p.get("spec") or {}).get("nodeName"))}
    return Observed(**found, nodes_not_ready=nodes_not_ready(nodes))


def node_readiness(node: dict[str, Any]) -> dict[str, Any]:
    """What `not_ready` reads of a node (its name, creation time and Ready condition): all
    that the node index keeps."""
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    meta = node["metadata"]
    return {"metadata": {"name": meta["name"], "creationTimestamp": meta.get("creationTimestamp")},
            "status": {"conditions": ready}}


def not_ready(names: set[str], node: Callable[[str], dict[str, Any] | None]) -> dict[str, datetime]:
    """The nodes among `names` whose Ready condition is not True, with since when (a node
    that no longer exists, `node(name)` None: since the epoch, i.e. lost)."""
    out = {}
    for name in sorted(names):
        obj = node(name)
        if obj is None:
            out[name] = datetime.fromtimestamp(0, timezone.utc)
            continue
        ready = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
        if ready is None or ready.get("status") != "True":
            since = (ready or {}).get("lastTransitionTime") or obj["metadata"].get("creationTimestamp")
            out[name] = datetime.strptime(since, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return out


def api_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


class Kube:
    """Thin, synchronous access to the API objects the operator reads and writes."""

    def __init__(self, api_client: client.ApiClient | None = None, connections: int = 32):
        """`connections`: HTTP connections kept open to the API server (one per reconcile
        worker; the client's default is 5 per CPU, and extra requests reconnect each time)."""
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            cfg = client.Configuration.get_default_copy()
            cfg.connection_pool_maxsize = connections
            api_client = client.ApiClient(cfg)
        self.api = api_client
        self._nodes: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._nodes_guard = threading.Lock()

    def request(self, method: str, path: str, *, body: Any = None, query: list | None = None,
              content_type: str = "application/json") -> tuple[Any, int]:
        method_, url, headers, body_, post = self.api.param_serialize(
            method, path, query_params=query or [],
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            body=body, auth_settings=["BearerToken"],
        )
        resp = self.api.call_api(method_, url, header_params=headers, body=body_, post_params=post,
                                 _request_timeout=TIMEOUT)
        raw = resp.read()
        if not 200 <= resp.status < 300:
            err = ApiException(status=resp.status, reason=resp.reason)
            err.body = raw.decode(errors="replace") if raw else ""
            raise err
        return (json.loads(raw) if raw else None), resp.status

    def read(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)[0]
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    # ---- the job
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.read(api_path(_API_VERSIONS["RLHFJob"], "RLHFJob", namespace, name))

    def list_jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        base = f"/apis/{API_GROUP}/{API_VERSION}"
        path = f"{base}/namespaces/{namespace}/{PLURAL}" if namespace else f"{base}/{PLURAL}"
        return self.request("GET", path)[0].get("items", [])

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the operator's part of the status (merge patch on the status subresource;
        `progress` is merged, so the trainer's fields survive)."""
        self.request("PATCH", api_path(_API_VERSIONS["RLHFJob"], "RLHFJob", namespace, name) + "/status",
                   body={"status": status}, content_type="application/merge-patch+json")

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        self.delete("RLHFJob", namespace, name, uid)

    # ---- children
    def observe(self, namespace: str, name: str, backend: str) -> Observed:
        """The job's children read from the API server (GETs and a pod LIST); the operator
        reads them from kopf's indexes instead, and this only to audit those."""
        def read(ck: ChildKind) -> list[dict[str, Any]]:
            if ck.name is None:
                return self.list_pods(namespace, f"{LABEL_JOB}={name}")
            obj = self.read(api_path(ck.api_version, ck.kind, namespace, ck.name(name)))
            return [obj] if obj is not None else []
        return self.with_adopted(observed_of(namespace, name, backend, read, self.nodes_not_ready), namespace, name,
                                 backend)

    def with_adopted(self, observed: Observed, namespace: str, name: str, backend: str) -> Observed:
        """The job's pods that its backend's controller made without the job's labels,
        labelled now and counted with the job's pods (`Backend.adopt`: backend TrainJob's)."""
        return adopt(self, observed, namespace, name, backend)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.request("GET", api_path("v1", "Pod", namespace),
                            query=[("labelSelector", selector)])[0].get("items", [])

    def patch_pod_labels(self, namespace: str, pod: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
        """Add `labels` to that pod (of its uid); the pod as patched."""
        return self.request("PATCH", api_path("v1", "Pod", namespace, pod["metadata"]["name"]),
                            body={"metadata": {"uid": pod["metadata"]["uid"], "labels": labels}},
                            content_type="application/merge-patch+json")[0]

    def claim_access_modes(self, namespace: str, name: str) -> list[str] | None:
        """A PersistentVolumeClaim's `spec.accessModes` (fixed at its creation); None: no such claim."""
        claim = self.read(f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{name}")  # read, never written
        return None if claim is None else list((claim.get("spec") or {}).get("accessModes") or [])

    def node(self, name: str) -> dict[str, Any] | None:
        """A node, read at most every NODE_CACHE_SECONDS (the jobs on it share the read)."""
        now = time.monotonic()
        with self._nodes_guard:
            hit = self._nodes.get(name)
            if hit and now - hit[0] < NODE_CACHE_SECONDS:
                return hit[1]
        node = self.read(f"/api/v1/nodes/{name}")
        with self._nodes_guard:
            self._nodes[name] = (now, node)
            if len(self._nodes) > 4096:  # forget the stalest half
                for old in sorted(self._nodes, key=lambda k: self._nodes[k][0])[:2048]:
                    self._nodes.pop(old, None)
        return node

    def nodes_not_ready(self, names: set[str]) -> dict[str, datetime]:
        return not_ready(names, self.node)

    def force_delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete the pod of that uid with grace period 0: the API server removes it without
        waiting for its kubelet (what the pod garbage collector does on an out-of-service node)."""
        return self.delete("Pod", namespace, name, uid, body={"gracePeriodSeconds": 0})

    def get(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The object of `obj`'s kind and name as the API server holds it, or None."""
        meta = obj["metadata"]
        return self.read(api_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]))

    def apply(self, obj: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
        """Server-side apply; with `uid`, of that object only (never a create: the API server
        refuses the apply when the object of the name has another uid, 422, or none, 409).
        Returns the object as written."""
        meta = obj["metadata"]
        path = api_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        body = {**obj, "metadata": {**meta, "uid": uid}} if uid else obj
        written, code = self.request("PATCH", path, body=body, content_type="application/apply-patch+yaml",
                                     query=[("fieldManager", FIELD_MANAGER), ("force", "true")])
        if code == 201:
            log.info("created %s %s/%s", obj["kind"], meta["namespace"], meta["name"])
        return written

    def delete(self, kind: str, namespace: str, name: str, uid: str | None = None,
               body: dict[str, Any] | None = None) -> bool:
        """Delete the object of that uid (background propagation: the garbage collector
        removes its pods); False when it is gone, or the name now holds another object (409).
        Every delete names the uid where it is known (None: whatever holds the name)."""
        api_version = _API_VERSIONS.get(kind, "v1")
        options = {"propagationPolicy": "Background", **(body or {}), **({"preconditions": {"uid": uid}} if uid else {})}
        try:
            self.request("DELETE", api_path(api_version, kind, namespace, name), body=options)
        except ApiException as err:
            if err.status == 409:
                log.warning("not deleting %s %s/%s: the name holds another object now", kind, namespace, name)
                return False
            if err.status == 404:
                return False
            raise
        log.info("deleted %s %s/%s", kind, namespace, name)
        return True

    def event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """An Event about the job; its message with URL credentials cut (`redact_text`: an
        error may quote a judge's URL)."""
        meta = job["metadata"]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": job.get("apiVersion"), "kind": job.get("kind"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid")},
            "type": type_, "reason": reason, "message": redact_text(message)[:1024],
            "firstTimestamp": now[:19] + "Z", "lastTimestamp": now[:19] + "Z", "count": 1,
            "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
            "reportingInstance": socket.gethostname(),
        }
        try:
            self.request("POST", api_path("v1", "Event", meta["namespace"]), body=body)
        except ApiException as err:  # an event is never worth failing a reconcile for
            log.warning("could not post event %s: %s", reason, err.reason)
