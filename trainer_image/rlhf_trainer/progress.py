"""Rank 0 writes `status.progress` of its own RLHFJob, so `kubectl get rlj` shows STEP and
REWARD while the job runs.

How: a JSON merge patch on the job's `status` subresource, over plain HTTPS (httpx), with
the token of the pod's service account (the operator gives trainer pods `<job>-trainer`,
whose Role allows exactly `get` / `patch` on this job's status). No Kubernetes client:
the trainer image does not carry one.

    PATCH /apis/rlhf.dev/v1alpha1/namespaces/<ns>/rlhfjobs/<name>/status
    Content-Type: application/merge-patch+json
    {"status": {"progress": {"step", "totalSteps", "rewardMean", "policyVersion",
                             "lastCheckpoint", "updatedTime", "sources"}}}

`sources` is {address: revision} of the job's pinned `hf://` / `s3://` sources
(rlhf_trainer.storage.pins, read from `$RLHF_OUTPUT_DIR/sources` once at start; also logged).

The run loop calls `ProgressReporter.report(...)` once per step; it only records the
values and returns at once. A background thread sends the newest values at most every
`min_interval` seconds (intermediate steps are skipped, never queued), so a slow or
unreachable API server never slows training, and nothing here ever raises into it:
failures are logged (once per kind of error, then again on recovery) and retried on the
next report. `close()` sends the last values (waiting a few seconds at most).

Local mode (no service-account token, or no namespace): every call is a no-op.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlhf_contract.api.models import API_GROUP, API_VERSION, PLURAL

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_MIN_INTERVAL = 5.0
REQUEST_TIMEOUT = 5.0


@dataclass(frozen=True)
class ApiServer:
    """Where and how to reach the API server from inside a pod."""

    url: str
    """https://host:port"""
    token_file: Path
    """Re-read before every request: the kubelet rotates projected tokens."""
    ca_file: Path | None
    """CA bundle of the API server's certificate (None: the system's)."""

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> "ApiServer | None":
        """From KUBERNETES_SERVICE_HOST / _PORT and the mounted token; None outside a pod."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        token = sa_dir / "token"
        if not host or not token.is_file():
            return None
        host = f"[{host}]" if ":" in host else host  # IPv6
        ca = sa_dir / "ca.crt"
        return cls(url=f"https://{host}:{port}", token_file=token, ca_file=ca if ca.is_file() else None)


def pinned_sources(output_dir: str | None = None) -> dict[str, str]:
    """{address: revision} pinned by the download step under `<output dir>/sources`
    (default: $RLHF_OUTPUT_DIR); logged once, since local mode has no status."""
    from rlhf_contract.pod import ENV_OUTPUT_DIR
    from rlhf_contract.sources import SOURCES_DIR

    from .storage.pins import summaries

    output_dir = output_dir or os.environ.get(ENV_OUTPUT_DIR)
    found = summaries(Path(output_dir, SOURCES_DIR)) if output_dir else {}
    for uri, revision in found.items():
        log.info("source %s pinned to %s", uri, revision)
    return found


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


class ProgressReporter:
    """Sends the newest progress of one job to its status, rate-limited, in the background."""

    def __init__(self, name: str, namespace: str | None, total_steps: int, *, api: ApiServer | None,
                 min_interval: float = DEFAULT_MIN_INTERVAL, sources: dict[str, str] | None = None):
        self.name, self.namespace, self.total_steps = name, namespace, total_steps
        self.sources = dict(sources or {})
        """{address: pinned revision} of the job's remote sources (status.progress.sources)."""
        self.api = api if namespace else None
        self.min_interval = min_interval
        self.sent = 0
        """Patches the API server accepted (for tests and logs)."""
        self.last_error: str | None = None
        self._pending: dict[str, Any] | None = None
        self._last_checkpoint: str | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._client = None
        if self.api is None:
            log.info("progress: no service-account token or namespace (local mode): status.progress is not written")

    @classmethod
    def from_config(cls, config: Any, *, min_interval: float = DEFAULT_MIN_INTERVAL) -> "ProgressReporter":
        """For a trainer in a pod: the job from the trainer config (`jobName`, `namespace`,
        `schedule.totalSteps`), the API server from the pod's service account."""
        return cls(config.job_name, config.namespace, config.schedule.total_steps, api=ApiServer.in_cluster(),
                   min_interval=min_interval, sources=pinned_sources())

    @property
    def enabled(self) -> bool:
        return self.api is not None

    @property
    def url(self) -> str:
        assert self.api is not None
        return (f"{self.api.url}/apis/{API_GROUP}/{API_VERSION}/namespaces/{self.namespace}/{PLURAL}/"
                f"{self.name}/status")

    def report(self, step: int, *, reward_mean: float | None = None, policy_version: int | None = None,
               last_checkpoint: str | None = None) -> None:
        """Record the progress after `step`; returns at once and never raises."""
        if self.api is None or self._closed:
            return
        try:
            progress: dict[str, Any] = {"step": int(step), "totalSteps": int(self.total_steps),
                                        "rewardMean": _finite(reward_mean),
                                        "updatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            if policy_version is not None:
                progress["policyVersion"] = int(policy_version)
            if last_checkpoint is not None:
                self._last_checkpoint = str(last_checkpoint)
            if self._last_checkpoint is not None:  # kept, so a skipped step's checkpoint is not lost
                progress["lastCheckpoint"] = self._last_checkpoint
            if self.sources:
                progress["sources"] = self.sources
            with self._cond:
                self._pending = progress
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="rlhf-progress", daemon=True)
                    self._thread.start()
                self._cond.notify()
        except Exception as err:  # a bad value must not stop training
            log.warning("progress: not reported (%s)", err)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is pending (the final step) and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- background thread ----------------------------------------------------------

    def _run(self) -> None:
        last_sent = -math.inf
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    break
                wait = last_sent + self.min_interval - time.monotonic()
                if wait > 0 and not self._closed:
                    self._cond.wait(wait)  # newer reports replace _pending meanwhile
                    continue
                progress, self._pending = self._pending, None
            last_sent = time.monotonic()
            if not self._send(progress) and not self._closed:
                with self._cond:  # retry with these values unless newer ones came
                    if self._pending is None:
                        self._pending = progress
        if self._client is not None:
            self._client.close()

    def _send(self, progress: dict[str, Any]) -> bool:
        import httpx

        assert self.api is not None
        try:
            if self._client is None:
                verify: Any = str(self.api.ca_file) if self.api.ca_file else True
                self._client = httpx.Client(verify=verify, timeout=REQUEST_TIMEOUT)
            token = self.api.token_file.read_text().strip()
            r = self._client.patch(self.url, json={"status": {"progress": progress}}, headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
            if r.status_code >= 400:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        except Exception as err:
            kind = f"{type(err).__name__}: {err}"[:200]
            if self.last_error is None or self.last_error.split(":")[0] != kind.split(":")[0]:
                log.warning("progress: cannot patch %s (%s); training goes on, retrying", self.url, kind)
            self.last_error = kind
            return False
        if self.last_error is not None:
            log.info("progress: patching %s works again", self.url)
        self.last_error = None
        self.sent += 1
        return True
