"""Kubeflow Trainer v2.0.0's controller (tests/cluster/trainer/build.sh) on the test control
plane, as a local process: its CRDs, its validating webhooks pointed at 127.0.0.1, and the
chart's ClusterTrainingRuntime `rlhf-torch`. Used by test_trainjob.py and
bench/operator_scale.py --backend TrainJob.

Its cert rotator reads no flag for its namespace (kubeflow-system) and keeps a Secret only
when it is valid for its own CA name and Service DNS name, so it gets a PKI of its own; its
webhook server reads the serving certificate under $TMPDIR (the training-operator's is in
/tmp)."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import yaml

from rlhf_operator.builders.trainjob import build_runtime

from . import pki
from .harness import Cluster, free_port, wait_for
from .procs import http_ok, terminate

BUILD = Path(__file__).parent / "trainer" / "build.sh"
NAMESPACE = "kubeflow-system"
SERVICE, SECRET, CA = "kubeflow-trainer-controller-manager", "kubeflow-trainer-webhook-cert", "kubeflow-trainer-ca"
WEBHOOK = "validator.trainer.kubeflow.org"


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


def _webhooks(manifests: Path, port: int, ca: Path) -> dict:
    (doc,) = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
    doc["metadata"] = {"name": WEBHOOK}
    for hook in doc["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": pki.b64(ca)}
        hook["timeoutSeconds"] = 10
    return doc


@contextmanager
def trainer_controller(cluster: Cluster, bin_dir: Path, root: Path):
    """Run the controller until the block ends; yields its log's path."""
    _pki(root)
    for crd in sorted((bin_dir / "crds").glob("trainer.kubeflow.org_*.yaml")):
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))
    for plural in ("trainjobs", "clustertrainingruntimes", "trainingruntimes"):
        cluster.wait_established(f"{plural}.trainer.kubeflow.org")
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                   "metadata": {"name": SECRET, "namespace": NAMESPACE},
                   "data": {n: pki.b64(root / n) for n in ("ca.crt", "ca.key", "tls.crt", "tls.key")}})
    port, health = free_port(), free_port()
    cluster.apply(_webhooks(bin_dir / "webhook" / "manifests.yaml", port, root / "ca.crt"))  # its CA injected here
    log_path = root / "trainer.log"
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [str(bin_dir / "trainer-controller-manager"), f"--webhook-server-port={port}", "--leader-elect=false",
         f"--health-probe-bind-address=127.0.0.1:{health}", "--metrics-bind-address=0"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "TMPDIR": str(root / "tmp")})
    try:
        wait_for(lambda: proc.poll() is None and http_ok(f"http://127.0.0.1:{health}/readyz"), 120,
                 "trainer-controller-manager /readyz")
        cluster.apply(build_runtime("example.invalid/trainer:1"))  # the chart's (tests/chart checks they match)
        yield log_path
    finally:  # the webhooks fail closed: gone before the controller is
        cluster.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK, "--ignore-not-found", check=False)
        terminate([proc.pid])
        log.close()
