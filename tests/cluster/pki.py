"""Certificates of the test control plane (openssl), made fresh for every cluster, and
the training-operator's webhook certificate, made once per machine."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import yaml

from .procs import ClusterError, flock

# The training-operator's webhook certificate handling (open-policy-agent cert-controller)
# is fixed to these names and to this directory; see docs/testing.md (Test cluster).
TO_NAMESPACE = "kubeflow"
TO_SECRET = "training-operator-webhook-cert"
TO_SERVICE = "training-operator"
TO_WEBHOOK_CONFIG = "validator.training-operator.kubeflow.org"
TO_CA_NAME = "training-operator-ca"
TO_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed: {proc.stderr}")


def make_ca(d: Path, name: str, cn: str, days: int = 3650) -> None:
    # -traditional: PKCS#1 RSA keys ("BEGIN RSA PRIVATE KEY"); cert-controller parses the CA
    # key only in that form.
    _openssl("genrsa", "-traditional", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.crt", "-days", str(days),
             "-subj", f"/CN={cn}",
             "-addext", f"subjectAltName=DNS:{cn}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature,keyEncipherment",
             cwd=d)


def make_cert(d: Path, name: str, ca: str, subj: str, ext: list[str], days: int = 3650) -> None:
    _openssl("genrsa", "-traditional", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=d)
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days),
             "-extfile", f"{name}.ext", cwd=d)


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def cluster_pki(d: Path, host_ip: str | None = None) -> None:
    """CA, API server serving cert, admin client cert, front proxy, service-account keys
    and an admin token, written into `d`. `host_ip`: the address the API server advertises
    (pods of the real node reach it there through the `kubernetes` Service)."""
    make_ca(d, "ca", "rlhf-test-cluster-ca")
    extra = f"IP:{host_ip}," if host_ip and host_ip != "127.0.0.1" else ""
    make_cert(d, "apiserver", "ca", "/CN=kube-apiserver", [
        f"subjectAltName=IP:127.0.0.1,{extra}IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
        "extendedKeyUsage=serverAuth",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ])
    make_cert(d, "admin", "ca", "/O=system:masters/CN=kubernetes-admin", [
        "extendedKeyUsage=clientAuth",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ])
    # Front proxy (request-header authentication), as on a kubeadm cluster: aggregated
    # API servers and the components' delegated authentication read it.
    make_ca(d, "front-proxy-ca", "front-proxy-ca")
    make_cert(d, "front-proxy-client", "front-proxy-ca", "/CN=front-proxy-client", [
        "extendedKeyUsage=clientAuth",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ])
    _openssl("genrsa", "-traditional", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    token = base64.b32encode(os.urandom(20)).decode().lower()
    (d / "admin.token").write_text(token + "\n")
    (d / "tokens.csv").write_text(f'{token},kubernetes-admin-token,admin-token,"system:masters"\n')


def write_kubeconfig(path: Path, server: str, pki: Path) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "rlhf-test", "cluster": {
            "server": server,
            "certificate-authority-data": b64(pki / "ca.crt")}}],
        "users": [{"name": "admin", "user": {
            "client-certificate-data": b64(pki / "admin.crt"),
            "client-key-data": b64(pki / "admin.key")}}],
        "contexts": [{"name": "rlhf-test", "context": {"cluster": "rlhf-test", "user": "admin"}}],
        "current-context": "rlhf-test",
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    path.chmod(0o600)


def webhook_pki() -> Path:
    """CA + serving cert for the training-operator's webhook, made once per machine.

    The operator reads its serving cert from a fixed path (/tmp/k8s-webhook-server/...),
    so every cluster on this machine must use the same pair; it lives in the user cache.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator" / "webhook-pki"
    with flock(cache.parent / ".webhook-pki.lock"):
        if not (cache / "tls.crt").exists():
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            make_ca(tmp, "ca", TO_CA_NAME)
            make_cert(tmp, "tls", "ca", f"/CN={TO_SERVICE}.{TO_NAMESPACE}.svc", [
                f"subjectAltName=DNS:{TO_SERVICE}.{TO_NAMESPACE}.svc,DNS:localhost,IP:127.0.0.1",
                "extendedKeyUsage=serverAuth",
                "keyUsage=critical,digitalSignature,keyEncipherment",
            ])
            shutil.rmtree(cache, ignore_errors=True)
            tmp.rename(cache)
        TO_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            src, dst = cache / name, TO_CERT_DIR / name
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                shutil.copyfile(src, dst)
    return cache
