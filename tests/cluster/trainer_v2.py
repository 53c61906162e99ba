"""Kubeflow Trainer v2.3's controller (tests/cluster/trainer/build.sh) on the test control
plane, as a local process: its CRDs, its defaulting (mutating) and validating webhooks
pointed at 127.0.0.1, and the chart's ClusterTrainingRuntime `rlhf-torch`. Used by
test_trainjob.py, test_kueue.py and bench/operator_scale.py --backend TrainJob.

v2.3 reads its settings from a Configuration file (`--config`; the v2.0 flags are gone):
the webhook and health ports, no metrics, no leader election, and no certificate management
(`certManagement.enable: false`): its webhook server reads the serving certificate of a PKI
of our own under $TMPDIR (the training-operator's is in /tmp), and the webhook
configurations get its CA here."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import yaml

from rlhf_operator.backends.trainjob import build_runtime

from . import pki
from .harness import Cluster, free_port, wait_for
from .procs import http_ok, terminate

BUILD = Path(__file__).parent / "trainer" / "build.sh"
NAMESPACE = "kubeflow-system"
SERVICE, CA = "kubeflow-trainer-controller-manager", "kubeflow-trainer-ca"
WEBHOOKS = {"MutatingWebhookConfiguration": "defaulter.trainer.kubeflow.org",
            "ValidatingWebhookConfiguration": "validator.trainer.kubeflow.org"}  # as v2.3's kustomize patches name them


def built() -> Path | None:
    """The build directory, or None when `make trainer-bin` has not run."""
    out = subprocess.run(["bash", str(BUILD), "--print"], capture_output=True, text=True).stdout.strip()
    return Path(out) if (Path(out) / ".complete").exists() else None


def _pki(root: Path) -> None:
    pki.make_ca(root, "ca", CA)
    pki.make_cert(root, "tls", "ca", f"/CN={SERVICE}.{NAMESPACE}.svc", [
        f"subjectAltName=DNS:{SERVICE}.{NAMESPACE}.svc,DNS:localhost,IP:127.0.0.1",
        "extendedKeyUsage=serverAuth", "keyUsage=critical,digitalSignature,keyEncipherment"])
    served = root / "tmp" / "k8s-webhook-server" / "serving-certs"
    served.mkdir(parents=True)
    for name in ("tls.crt", "tls.key"):
        (served / name).write_bytes((root / name).read_bytes())


def _webhooks(manifests: Path, port: int, ca: Path) -> list[dict]:
    docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    for doc in docs:
        doc["metadata"] = {"name": WEBHOOKS[doc["kind"]]}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": pki.b64(ca)}
            hook["timeoutSeconds"] = 10
    return docs


def _config(root: Path, port: int, health: int) -> Path:
    path = root / "trainer-config.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"}, "metrics": {"bindAddress": "0"},
        "webhook": {"port": port, "host": "127.0.0.1"}, "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False}}))
    return path


@contextmanager
def trainer_controller(cluster: Cluster, bin_dir: Path, root: Path):
    """Run the controller until the block ends; yields its log's path."""
    _pki(root)
    for crd in sorted((bin_dir / "crds").glob("trainer.kubeflow.org_*.yaml")):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    for plural in ("trainjobs", "clustertrainingruntimes", "trainingruntimes"):
        cluster.wait_established(f"{plural}.trainer.kubeflow.org")
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    port, health = free_port(), free_port()
    for doc in _webhooks(bin_dir / "webhook" / "manifests.yaml", port, root / "ca.crt"):  # its CA injected here
        cluster.apply(doc)
    log_path = root / "trainer.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [str(bin_dir / "trainer-controller-manager"), f"--config={_config(root, port, health)}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "TMPDIR": str(root / "tmp")})
    try:
        wait_for(lambda: proc.poll() is None and http_ok(f"http://127.0.0.1:{health}/readyz"), 120,
                 "trainer-controller-manager /readyz")
        cluster.apply(build_runtime("example.invalid/trainer:1"))  # the chart's (tests/chart checks they match)
        yield log_path
    finally:  # the webhooks fail closed: gone before the controller is
        for kind, name in WEBHOOKS.items():
            cluster.kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        terminate([proc.pid])
        log.close()
