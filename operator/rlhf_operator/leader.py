"""Leader election on a coordination.k8s.io Lease, so that of several operator replicas
exactly one acts (kopf's handlers run only while this process holds the lease)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone

from kubernetes.client.rest import ApiException

from .kube import Kube, api_path

log = logging.getLogger(__name__)


class Lease:
    """Leader election on a coordination.k8s.io Lease, as client-go does it: a holder
    renews every `duration / 3`; another candidate takes over only after the record has
    not changed for `duration` seconds of its own clock (no clock-skew assumptions)."""

    def __init__(self, kube: Kube, namespace: str, name: str = "rlhf-operator", duration: int = 15,
                 identity: str | None = None):
        self.kube, self.namespace, self.name, self.duration = kube, namespace, name, duration
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}"
        self._seen: tuple[str | None, float] = (None, 0.0)  # (resourceVersion, local time first seen)
        self.path = api_path("coordination.k8s.io/v1", "Lease", namespace, name)

    def _now(self) -> str:
        return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def try_acquire(self) -> bool:
        lease = self.kube.read(self.path)
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration, "renewTime": self._now()}
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": {**spec, "acquireTime": self._now(), "leaseTransitions": 0}}
            try:
                self.kube.request("POST", api_path("coordination.k8s.io/v1", "Lease", self.namespace), body=body)
                return True
            except ApiException as err:
                if err.status == 409:
                    return False
                raise
        rv = lease["metadata"]["resourceVersion"]
        holder = lease.get("spec", {}).get("holderIdentity") or ""
        if holder and holder != self.identity:
            if self._seen[0] != rv:
                self._seen = (rv, time.monotonic())
                return False
            if time.monotonic() - self._seen[1] < lease["spec"].get("leaseDurationSeconds", self.duration):
                return False
        lease["spec"].update(spec)
        if holder != self.identity:
            lease["spec"]["acquireTime"] = self._now()
            lease["spec"]["leaseTransitions"] = lease["spec"].get("leaseTransitions", 0) + 1
        try:
            self.kube.request("PUT", self.path, body=lease)  # resourceVersion: optimistic concurrency
            return True
        except ApiException as err:
            if err.status == 409:
                return False
            raise

    def release(self) -> None:
        lease = self.kube.read(self.path)
        if lease and lease.get("spec", {}).get("holderIdentity") == self.identity:
            lease["spec"]["holderIdentity"] = ""
            try:
                self.kube.request("PUT", self.path, body=lease)
            except ApiException:
                pass

    def hold(self, stop: threading.Event, lost) -> None:
        """Renew until `stop` is set; call `lost()` when renewal failed for `duration`."""
        last_ok = time.monotonic()
        while not stop.wait(self.duration / 3):
            try:
                if self.try_acquire():
                    last_ok = time.monotonic()
                    continue
            except Exception as err:  # noqa: BLE001 - API errors while renewing
                log.warning("lease renewal failed: %s", err)
            if time.monotonic() - last_ok > self.duration * 2 / 3:
                lost()
                return
