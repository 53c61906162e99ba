"""The LeaderWorkerSet controller v0.9.0 (tests/cluster/lws/build.sh) on the test control
plane, as a local process: its CRD, its defaulting and validating webhooks (the LWS ones and
the pod ones, which set a group's labels and LWS_* variables on its pods) pointed at 127.0.0.1
with the objectSelector of LWS's own kustomize patch, so only a group's pods go through them.
Used by test_lws.py.

Its settings come from a Configuration file (`--config`): webhook port and host, a serving
certificate of a PKI of our own (`internalCertManagement.enable: false`: no cert rotation
through a Secret), no metrics, no leader election."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import yaml

from . import pki
from .harness import Cluster, free_port, wait_for
from .procs import http_ok, terminate

BUILD = Path(__file__).parent / "lws" / "build.sh"
SERVICE, NAMESPACE, CA = "lws-webhook-service", "lws-system", "lws-ca"
WEBHOOKS = {"MutatingWebhookConfiguration": "lws-mutating-webhook-configuration",
            "ValidatingWebhookConfiguration": "lws-validating-webhook-configuration"}
POD_HOOKS = ("/mutate--v1-pod", "/validate--v1-pod")
ONLY_GROUP_PODS = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def built() -> Path | None:
    """The build directory, or None when `make lws-bin` has not run."""
    out = subprocess.run(["bash", str(BUILD), "--print"], capture_output=True, text=True).stdout.strip()
    return Path(out) if (Path(out) / ".complete").exists() else None


def _pki(root: Path) -> Path:
    pki.make_ca(root, "ca", CA)
    pki.make_cert(root, "tls", "ca", f"/CN={SERVICE}.{NAMESPACE}.svc", [
        f"subjectAltName=DNS:{SERVICE}.{NAMESPACE}.svc,DNS:localhost,IP:127.0.0.1",
        "extendedKeyUsage=serverAuth", "keyUsage=critical,digitalSignature,keyEncipherment"])
    certs = root / "certs"
    certs.mkdir(parents=True)
    for name in ("tls.crt", "tls.key"):
        (certs / name).write_bytes((root / name).read_bytes())
    return certs


def _webhooks(manifests: Path, port: int, ca: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    for doc in docs:
        doc["metadata"] = {"name": WEBHOOKS[doc["kind"]]}
        doc["webhooks"] = [h for h in doc["webhooks"] if "disaggregatedset" not in h["clientConfig"]["service"]["path"]]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": pki.b64(ca)}
            hook["timeoutSeconds"] = 10
            if path in POD_HOOKS:  # as LWS's config/webhook/*-patch.yaml
                hook["objectSelector"] = ONLY_GROUP_PODS
    return docs


def _config(root: Path, port: int, health: int, certs: Path) -> Path:
    path = root / "lws-config.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"}, "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
        "leaderElection": {"leaderElect": False}, "internalCertManagement": {"enable": False}}))
    return path


@contextmanager
def lws_controller(cluster: Cluster, bin_dir: Path, root: Path):
    """Run the controller until the block ends; yields its log's path."""
    certs = _pki(root)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f",
                    str(bin_dir / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"))
    cluster.wait_established("leaderworkersets.leaderworkerset.x-k8s.io")
    port, health = free_port(), free_port()
    for doc in _webhooks(bin_dir / "webhook" / "manifests.yaml", port, root / "ca.crt"):
        cluster.apply(doc)
    log_path = root / "lws.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [str(bin_dir / "lws-controller-manager"), f"--config={_config(root, port, health, certs)}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    try:
        wait_for(lambda: proc.poll() is None and http_ok(f"http://127.0.0.1:{health}/readyz"), 120,
                 "lws-controller-manager /readyz")
        yield log_path
    finally:  # the webhooks fail closed: gone before the controller is
        for kind, name in WEBHOOKS.items():
            cluster.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        terminate([proc.pid])
        log.close()
