"""A real Kubernetes control plane for the tests, run as local processes.

    etcd -> kube-apiserver (TLS, RBAC, client-cert + token admin, service-account keys)
         -> kube-controller-manager, kube-scheduler
         -> kwok (fake nodes with nvidia.com/gpu capacity, pod/node stages incl. chaos)
         -> Kubeflow training-operator (PyTorchJob CRD + validating webhook)

The binaries come from tests/cluster/build.sh (Go modules, cached outside the repository).
Everything a running cluster needs lives in one state directory, `.cluster/` in the
repository by default: `kubeconfig`, `pki/`, `etcd/`, `logs/<process>.log`, `state.json`
(pids and ports, so another process can attach to or stop the cluster).

Command line (what `make cluster` / `make cluster-down` run):

    python tests/cluster/harness.py up [--nodes N] [--dir DIR]
    python tests/cluster/harness.py down [--dir DIR]
    python tests/cluster/harness.py status [--dir DIR]

Only the standard library and PyYAML are used here, so the module imports anywhere.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD_SCRIPT = HERE / "build.sh"
DEFAULT_DIR = Path(os.environ.get("RLHF_CLUSTER_DIR", REPO / ".cluster"))

# Nodes kwok manages carry this annotation (kwok runs with
# --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake).
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"

# Chaos and request labels/annotations understood by the kwok stages loaded here.
# Pod failure: kwok's own chaos stage `pod-container-running-failed`.
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_ANNOTATION_PREFIX = "pod-container-running-failed.stage.kwok.x-k8s.io/"
# Node NotReady: kwok's own chaos stage `node-not-ready`.
NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
# Pod completion on request: a stage of ours (below); any Running pod with this label
# ends as Succeeded with exit code 0 in every container.
COMPLETE_LABEL = "stage.rlhf.dev/complete"

# The training-operator's webhook certificate handling (open-policy-agent cert-controller)
# is fixed to these names and to this directory; see build notes in the README.
TO_NAMESPACE = "kubeflow"
TO_SECRET = "training-operator-webhook-cert"
TO_SERVICE = "training-operator"
TO_WEBHOOK_CONFIG = "validator.training-operator.kubeflow.org"
TO_CA_NAME = "training-operator-ca"
TO_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")

KUBE_ORDER = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
              "training-operator"]

# A stage of ours for "complete this pod": the pod's containers terminate with exit code 0.
COMPLETE_STAGE = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: rlhf-pod-complete-on-request
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.labels["%(label)s"]'
      operator: 'In'
      values: ['true']
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
  weight: 10000
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "False"
        reason: PodCompleted
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "False"
        reason: PodCompleted
        type: ContainersReady
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            reason: Completed
            startedAt: {{ $now | Quote }}
            finishedAt: {{ $now | Quote }}
      {{ end }}
      phase: Succeeded
""" % {"label": COMPLETE_LABEL}


class ClusterError(RuntimeError):
    pass


# ---------------------------------------------------------------- binaries


def ensure_binaries(quiet: bool = False) -> Path:
    """Build (or find in the cache) the control-plane binaries; return their directory."""
    override = os.environ.get("RLHF_CLUSTER_BIN")
    if override:
        return Path(override)
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )
    if proc.returncode != 0:
        raise ClusterError(f"{BUILD_SCRIPT} failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def binaries_built() -> bool:
    if os.environ.get("RLHF_CLUSTER_BIN"):
        return True
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print"], capture_output=True, text=True)
    return (Path(out.stdout.strip()) / ".complete").exists()


# ---------------------------------------------------------------- small helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.25):
    """Poll `predicate` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - polled condition may fail transiently
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                       + (f" (last error: {last_exc})" if last_exc else ""))


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"openssl {' '.join(args)} failed: {proc.stderr}")


def _make_ca(d: Path, name: str, cn: str, days: int = 3650) -> None:
    # -traditional: PKCS#1 RSA keys ("BEGIN RSA PRIVATE KEY"); cert-controller parses the CA
    # key only in that form.
    _openssl("genrsa", "-traditional", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-x509", "-new", "-key", f"{name}.key", "-out", f"{name}.crt", "-days", str(days),
             "-subj", f"/CN={cn}",
             "-addext", f"subjectAltName=DNS:{cn}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature,keyEncipherment",
             cwd=d)


def _make_cert(d: Path, name: str, ca: str, subj: str, ext: list[str], days: int = 3650) -> None:
    _openssl("genrsa", "-traditional", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-out", f"{name}.csr", "-subj", subj, cwd=d)
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days),
             "-extfile", f"{name}.ext", cwd=d)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


@contextlib.contextmanager
def _flock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def webhook_pki() -> Path:
    """CA + serving cert for the training-operator's webhook, made once per machine.

    The operator reads its serving cert from a fixed path (/tmp/k8s-webhook-server/...),
    so every cluster on this machine must use the same pair; it lives in the user cache.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlhf-operator" / "webhook-pki"
    with _flock(cache.parent / ".webhook-pki.lock"):
        if not (cache / "tls.crt").exists():
            tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            _make_ca(tmp, "ca", TO_CA_NAME)
            _make_cert(tmp, "tls", "ca", f"/CN={TO_SERVICE}.{TO_NAMESPACE}.svc", [
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


# ---------------------------------------------------------------- the cluster


class Cluster:
    """A control plane rooted at `root` (default `.cluster/` in the repository)."""

    def __init__(self, root: Path | str = DEFAULT_DIR, bin_dir: Path | None = None):
        self.root = Path(root).resolve()
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.owned = False  # True when this object started the processes

    # ---- paths
    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def bin(self, name: str) -> str:
        assert self.bin_dir is not None
        return str(self.bin_dir / name)

    @property
    def env(self) -> dict[str, str]:
        """Environment for kubectl / helm / kopf / the Python client against this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        if self.bin_dir:
            env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("HELM_CACHE_HOME", str(self.root / "helm" / "cache"))
        env.setdefault("HELM_CONFIG_HOME", str(self.root / "helm" / "config"))
        env.setdefault("HELM_DATA_HOME", str(self.root / "helm" / "data"))
        return env

    # ---- attach / state
    @classmethod
    def attach(cls, root: Path | str = DEFAULT_DIR) -> "Cluster | None":
        """The cluster already running in `root`, or None."""
        c = cls(root)
        if not c.state_file.exists():
            return None
        try:
            st = json.loads(c.state_file.read_text())
        except ValueError:
            return None
        c.ports = st["ports"]
        c.pids = st["pids"]
        c.bin_dir = Path(st["bin_dir"])
        if not all(_pid_alive(p, c.bin_dir) for p in c.pids.values()):
            return None
        try:
            c._apiserver_ready()
        except Exception:  # noqa: BLE001
            return None
        return c

    def _write_state(self) -> None:
        self.state_file.write_text(json.dumps(
            {"ports": self.ports, "pids": self.pids, "bin_dir": str(self.bin_dir)}, indent=2))

    # ---- processes
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")
        log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
        log.flush()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env or os.environ.copy(), cwd=self.root, start_new_session=True)
        log.close()
        self.procs[name] = proc
        self.pids[name] = proc.pid
        self._write_state()

    def _check_alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is not None:
            raise ClusterError(f"{name} exited with {proc.returncode}\n{self.log_tail(name)}")
        return True

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return f"({path} missing)"
        text = path.read_text(errors="replace").splitlines()
        return f"--- {path} (last {lines} lines)\n" + "\n".join(text[-lines:])

    def all_log_tails(self, lines: int = 40) -> str:
        return "\n".join(self.log_tail(n, lines) for n in KUBE_ORDER)

    # ---- start
    def start(self, nodes: int = 4, gpus_per_node: int = 8, timeout: float = 180.0) -> "Cluster":
        if self.bin_dir is None:
            self.bin_dir = ensure_binaries()
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        old = Cluster.attach(self.root)
        if old is not None:
            old.stop()
        else:
            Cluster._kill_from_state(self.root)
        for sub in ("etcd", "pki", "kcm-certs", "scheduler-certs", "helm"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self.logs.mkdir(exist_ok=True)
        for old_log in self.logs.glob("*.log"):
            old_log.unlink()
        self.pki.mkdir()
        self.owned = True
        for name in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok", "to_webhook",
                     "to_metrics", "to_health"):
            self.ports[name] = free_port()
        try:
            self._make_pki()
            self._write_kubeconfig()
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers(timeout)
            self._start_kwok(timeout)
            self.create_nodes(nodes, gpus=gpus_per_node)
            self._start_training_operator(timeout)
            self.wait_nodes_ready(timeout=timeout)
        except BaseException as exc:
            tails = self.all_log_tails()
            self.stop()
            if isinstance(exc, (ClusterError, TimeoutError)):
                raise ClusterError(f"cluster start failed: {exc}\n{tails}") from exc
            raise
        self.started_in = time.monotonic() - t0
        (self.root / "started.txt").write_text(f"{self.started_in:.1f}\n")
        return self

    def _make_pki(self) -> None:
        d = self.pki
        _make_ca(d, "ca", "rlhf-test-cluster-ca")
        _make_cert(d, "apiserver", "ca", "/CN=kube-apiserver", [
            "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local",
            "extendedKeyUsage=serverAuth",
            "keyUsage=critical,digitalSignature,keyEncipherment",
        ])
        _make_cert(d, "admin", "ca", "/O=system:masters/CN=kubernetes-admin", [
            "extendedKeyUsage=clientAuth",
            "keyUsage=critical,digitalSignature,keyEncipherment",
        ])
        # Front proxy (request-header authentication), as on a kubeadm cluster: aggregated
        # API servers and the components' delegated authentication read it.
        _make_ca(d, "front-proxy-ca", "front-proxy-ca")
        _make_cert(d, "front-proxy-client", "front-proxy-ca", "/CN=front-proxy-client", [
            "extendedKeyUsage=clientAuth",
            "keyUsage=critical,digitalSignature,keyEncipherment",
        ])
        _openssl("genrsa", "-traditional", "-out", "sa.key", "2048", cwd=d)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        token = base64.b32encode(os.urandom(20)).decode().lower()
        (d / "admin.token").write_text(token + "\n")
        (d / "tokens.csv").write_text(f'{token},kubernetes-admin-token,admin-token,"system:masters"\n')

    def _write_kubeconfig(self) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "rlhf-test", "cluster": {
                "server": self.server,
                "certificate-authority-data": _b64(self.pki / "ca.crt")}}],
            "users": [{"name": "admin", "user": {
                "client-certificate-data": _b64(self.pki / "admin.crt"),
                "client-key-data": _b64(self.pki / "admin.key")}}],
            "contexts": [{"name": "rlhf-test", "context": {"cluster": "rlhf-test", "user": "admin"}}],
            "current-context": "rlhf-test",
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _https_get(self, url: str, client_cert: bool = True, verify: bool = True) -> tuple[int, str]:
        if verify:
            ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        else:
            ctx = ssl._create_unverified_context()  # noqa: S323 - self-signed component certs
        if client_cert:
            ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=5) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    @staticmethod
    def _http_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _start_etcd(self, timeout: float) -> None:
        p, peer = self.ports["etcd"], self.ports["etcd_peer"]
        self._spawn("etcd", [
            self.bin("etcd"), "--name=default", f"--data-dir={self.root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{p}", f"--advertise-client-urls=http://127.0.0.1:{p}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648",
        ])
        wait_for(lambda: self._check_alive("etcd") and self._http_ok(f"http://127.0.0.1:{p}/health"),
                 timeout, "etcd /health")

    def _apiserver_ready(self) -> bool:
        code, body = self._https_get(f"{self.server}/readyz")
        return code == 200

    def _start_apiserver(self, timeout: float) -> None:
        d = self.pki
        self._spawn("kube-apiserver", [
            self.bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={self.root / 'pki'}",
            f"--tls-cert-file={d / 'apiserver.crt'}", f"--tls-private-key-file={d / 'apiserver.key'}",
            f"--client-ca-file={d / 'ca.crt'}",
            f"--token-auth-file={d / 'tokens.csv'}",
            f"--requestheader-client-ca-file={d / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={d / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={d / 'front-proxy-client.key'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={d / 'sa.pub'}",
            f"--service-account-signing-key-file={d / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            "--profiling=false",
            "--enable-priority-and-fairness=false",
            "--event-ttl=30m",
        ])
        wait_for(lambda: self._check_alive("kube-apiserver") and self._apiserver_ready(),
                 timeout, "kube-apiserver /readyz")

    def _start_controllers(self, timeout: float) -> None:
        kc = str(self.kubeconfig)
        d = self.pki
        self._spawn("kube-controller-manager", [
            self.bin("kube-controller-manager"),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['kcm']}",
            f"--cert-dir={self.root / 'kcm-certs'}",
            "--leader-elect=false",
            "--controllers=*",
            f"--service-account-private-key-file={d / 'sa.key'}",
            f"--root-ca-file={d / 'ca.crt'}",
            "--use-service-account-credentials=true",
            "--concurrent-gc-syncs=5",
            "--profiling=false",
        ])
        self._spawn("kube-scheduler", [
            self.bin("kube-scheduler"),
            f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1", f"--secure-port={self.ports['scheduler']}",
            f"--cert-dir={self.root / 'scheduler-certs'}",
            "--leader-elect=false",
            "--profiling=false",
        ])
        for name, port in (("kube-controller-manager", "kcm"), ("kube-scheduler", "scheduler")):
            url = f"https://127.0.0.1:{self.ports[port]}/healthz"
            wait_for(lambda: self._check_alive(name)
                     and self._https_get(url, client_cert=False, verify=False)[0] == 200,
                     timeout, f"{name} /healthz")
        # The service-account controllers are up once `default` exists in `default`.
        wait_for(lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default",
                                      check=False).returncode == 0,
                 timeout, "the default service account")

    def _kwok_stages(self) -> str:
        assert self.bin_dir is not None
        docs = [p.read_text() for p in sorted((self.bin_dir / "manifests" / "kwok-stages").glob("*.yaml"))]
        docs.append(COMPLETE_STAGE)
        return "\n---\n".join(d.strip("\n").removeprefix("---\n") for d in docs) + "\n"

    def _start_kwok(self, timeout: float) -> None:
        cfg = self.root / "kwok-stages.yaml"
        cfg.write_text(self._kwok_stages())
        key, value = KWOK_NODE_ANNOTATION
        self._spawn("kwok", [
            self.bin("kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={cfg}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            f"--server-address=127.0.0.1:{self.ports['kwok']}",
            "--cidr=10.244.0.1/16", "--node-ip=10.240.0.1",
        ])
        wait_for(lambda: self._check_alive("kwok")
                 and self._http_ok(f"http://127.0.0.1:{self.ports['kwok']}/healthz"),
                 timeout, "kwok /healthz")

    def _start_training_operator(self, timeout: float) -> None:
        assert self.bin_dir is not None
        pki = webhook_pki()
        crd = self.bin_dir / "manifests" / "kubeflow.org_pytorchjobs.yaml"
        self.kubectl("apply", "--server-side", "-f", str(crd))
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": TO_NAMESPACE}})
        self.apply({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": TO_SECRET, "namespace": TO_NAMESPACE},
            "data": {n: _b64(pki / n) for n in ("ca.crt", "ca.key", "tls.crt", "tls.key")},
        })
        webhook_port = self.ports["to_webhook"]
        self.apply({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": TO_WEBHOOK_CONFIG},
            "webhooks": [{
                "name": "validator.pytorchjob.training-operator.kubeflow.org",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {
                    "url": f"https://127.0.0.1:{webhook_port}/validate-kubeflow-org-v1-pytorchjob",
                    "caBundle": _b64(pki / "ca.crt"),
                },
                "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"],
                           "operations": ["CREATE", "UPDATE"], "resources": ["pytorchjobs"]}],
            }],
        })
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                     "crd/pytorchjobs.kubeflow.org")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "MY_POD_NAMESPACE": TO_NAMESPACE}
        self._spawn("training-operator", [
            self.bin("training-operator"),
            "--enable-scheme=pytorchjob",
            f"--metrics-bind-address=127.0.0.1:{self.ports['to_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{self.ports['to_health']}",
            f"--webhook-server-port={webhook_port}",
            f"--webhook-service-name={TO_SERVICE}",
            f"--webhook-secret-name={TO_SECRET}",
            "--leader-elect=false",
        ], env=env)
        wait_for(lambda: self._check_alive("training-operator")
                 and self._http_ok(f"http://127.0.0.1:{self.ports['to_health']}/readyz"),
                 timeout, "training-operator /readyz")

    # ---- stop
    @staticmethod
    def _kill_from_state(root: Path) -> None:
        state = root / "state.json"
        if not state.exists():
            return
        try:
            st = json.loads(state.read_text())
        except ValueError:
            state.unlink()
            return
        bin_dir = Path(st.get("bin_dir", ""))
        pids = [st["pids"][n] for n in reversed(KUBE_ORDER) if n in st.get("pids", {})]
        _terminate([p for p in pids if _pid_alive(p, bin_dir)])
        state.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop every process of this cluster (reverse start order); logs stay."""
        order = [n for n in reversed(KUBE_ORDER) if n in self.pids]
        alive = [self.pids[n] for n in order
                 if (n in self.procs and self.procs[n].poll() is None)
                 or (n not in self.procs and self.bin_dir and _pid_alive(self.pids[n], self.bin_dir))]
        _terminate(alive)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        self.procs.clear()
        self.pids.clear()
        self.state_file.unlink(missing_ok=True)

    # ---- kubectl / helm
    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.bin("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.bin("helm"), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def apply(self, *objects: dict) -> None:
        """Server-side apply of manifests given as dicts."""
        text = yaml.safe_dump_all(objects, sort_keys=False)
        self.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=rlhf-test-harness",
                     "-f", "-", input=text)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None,
            selector: str | None = None) -> dict:
        args = ["get", kind] + ([name] if name else []) + ["-o", "json"]
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args).stdout)

    def api_client(self):
        """A `kubernetes.client.ApiClient` for this cluster (needs the kubernetes package)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))

    # ---- fake nodes and chaos
    def create_nodes(self, count: int, prefix: str = "kwok-node", gpus: int = 8, cpu: str = "64",
                     memory: str = "512Gi", labels: dict[str, str] | None = None,
                     start: int | None = None) -> list[str]:
        """Create `count` fake nodes that kwok manages, each with `nvidia.com/gpu: gpus`."""
        if start is None:
            existing = self.get("nodes")["items"]
            taken = {n["metadata"]["name"] for n in existing}
            start = 0
            while f"{prefix}-{start}" in taken:
                start += 1
        names = [f"{prefix}-{i}" for i in range(start, start + count)]
        key, value = KWOK_NODE_ANNOTATION
        capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        if gpus:
            capacity[GPU_RESOURCE] = str(gpus)
        nodes = [{
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": n,
                "annotations": {key: value, "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {"type": "kwok", "kubernetes.io/hostname": n, "kubernetes.io/os": "linux",
                           "kubernetes.io/arch": "amd64", "kubernetes.io/role": "agent",
                           "nvidia.com/gpu.count": str(gpus), **(labels or {})},
            },
            "spec": {},
            "status": {"capacity": capacity, "allocatable": dict(capacity),
                       "nodeInfo": {"kubeletVersion": "fake", "kubeProxyVersion": "fake",
                                    "architecture": "amd64", "operatingSystem": "linux"}},
        } for n in names]
        # `kubectl create` keeps status on create for nodes; apply would drop it.
        self.kubectl("create", "-f", "-", input=yaml.safe_dump_all(nodes))
        return names

    def node_ready(self, name: str) -> bool:
        node = self.get("node", name)
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in node.get("status", {}).get("conditions", []))

    def wait_nodes_ready(self, names: Iterable[str] | None = None, timeout: float = 60) -> None:
        def ready() -> bool:
            nodes = self.get("nodes")["items"]
            want = set(names) if names is not None else {n["metadata"]["name"] for n in nodes}
            ok = {n["metadata"]["name"] for n in nodes
                  if any(c["type"] == "Ready" and c["status"] == "True"
                         for c in n.get("status", {}).get("conditions", []))}
            return want <= ok
        wait_for(ready, timeout, "nodes Ready")

    def fail_pod(self, namespace: str, name: str, exit_code: int = 1, reason: str = "Error",
                 message: str = "failed on request", container: str | None = None) -> None:
        """Make a Running pod's container(s) terminate with `exit_code` (pod phase Failed)."""
        p = FAIL_ANNOTATION_PREFIX
        annotations = {f"{p}exit-code": str(exit_code), f"{p}reason": reason, f"{p}message": message,
                       f"{p}delay": "0", f"{p}jitter-delay": "0"}
        if container:
            annotations[f"{p}container-name"] = container
        patch = {"metadata": {"annotations": annotations, "labels": {FAIL_LABEL: "true"}}}
        self.kubectl("patch", "pod", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch))

    def complete_pod(self, namespace: str, name: str) -> None:
        """Make a Running pod succeed (every container exits 0)."""
        patch = {"metadata": {"labels": {COMPLETE_LABEL: "true"}}}
        self.kubectl("patch", "pod", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch))

    def set_node_ready(self, name: str, ready: bool, reason: str = "NodeFailedOnRequest") -> None:
        """Flip a fake node NotReady (kwok's node-not-ready stage) or back to Ready."""
        if ready:
            patch = {"metadata": {"labels": {NOT_READY_LABEL: None}}}
        else:
            patch = {"metadata": {
                "labels": {NOT_READY_LABEL: "true"},
                "annotations": {f"{NOT_READY_LABEL}/reason": reason,
                                f"{NOT_READY_LABEL}/delay": "0", f"{NOT_READY_LABEL}/jitter-delay": "0"}}}
        self.kubectl("patch", "node", name, "--type=merge", "-p", json.dumps(patch))

    def pod_phase(self, namespace: str, name: str) -> str | None:
        proc = self.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}",
                            check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None


def _pid_alive(pid: int, bin_dir: Path) -> bool:
    """True when `pid` runs one of our binaries (guards against recycled pids)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return Path(exe).parent == Path(bin_dir)


def _terminate(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM one by one in the given order (clients before the API server before etcd:
    an API server whose etcd is gone shuts down slowly), SIGKILL after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _exists(pid):
            time.sleep(0.1)
        if _exists(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        # Reap it if it is our child; otherwise just probe.
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1].split()[0] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["up", "down", "status", "build"])
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="state directory (default: .cluster/)")
    ap.add_argument("--nodes", type=int, default=4, help="fake GPU nodes to create")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if args.command == "build":
        print(ensure_binaries())
        return 0
    if args.command == "down":
        c = Cluster.attach(root)
        if c is not None:
            c.stop()
        else:
            Cluster._kill_from_state(root)
        print(f"cluster in {root} stopped (logs kept in {root / 'logs'})")
        return 0
    if args.command == "status":
        c = Cluster.attach(root)
        if c is None:
            print(f"no cluster running in {root}")
            return 1
        print(f"running: {c.server}, kubeconfig {c.kubeconfig}")
        print(c.kubectl("get", "nodes").stdout)
        return 0
    bin_dir = ensure_binaries()
    c = Cluster(root, bin_dir=bin_dir).start(nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    print(f"cluster up in {c.started_in:.1f}s: {c.server}")
    print(f"  export KUBECONFIG={c.kubeconfig}")
    print(f"  export PATH={bin_dir}:$PATH   # kubectl, helm, kwok ...")
    print(f"  logs: {c.logs}/   stop: make cluster-down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
