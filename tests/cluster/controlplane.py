"""Bring-up and shut-down of the test control plane, run as local processes:

    etcd -> kube-apiserver (TLS, RBAC, client-cert + token admin, service-account keys)
         -> kube-controller-manager, kube-scheduler
         -> kwok (fake nodes with nvidia.com/gpu capacity, node Leases, chaos stages)
         -> Kubeflow training-operator (PyTorchJob CRD + validating webhook)

Everything a running cluster needs lives in one state directory, `.cluster/` in the
repository by default: `kubeconfig`, `pki/`, `etcd/`, `logs/<process>.log`, `state.json`
(pids and ports, so another process can attach to or stop the cluster).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from . import pki
from .client import KubeClient
from .kwok import FakeNodes
from .procs import ClusterError, ensure_binaries, free_port, http_ok, pid_alive, terminate, wait_for

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = Path(os.environ.get("RLHF_CLUSTER_DIR", REPO / ".cluster"))
KUBE_ORDER = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
              "training-operator", "jobset"]


def host_ip() -> str:
    """The host's address on its default route (what pods of the real node reach it at);
    127.0.0.1 when there is none."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.254.254.254", 9))  # no packet is sent: this only picks the route's source
        return s.getsockname()[0]
    return "127.0.0.1"


def _stop_order(names) -> list[str]:
    """Reverse start order; processes started later (extra kwok groups) first."""
    extra = [n for n in names if n not in KUBE_ORDER]
    return extra + [n for n in reversed(KUBE_ORDER) if n in names]


class Cluster(KubeClient, FakeNodes):
    """A control plane rooted at `root` (default `.cluster/` in the repository)."""

    def __init__(self, root: Path | str = DEFAULT_DIR, bin_dir: Path | None = None):
        self.root = Path(root).resolve()
        self.bin_dir = Path(bin_dir) if bin_dir else None
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.owned = False  # True when this object started the processes
        self.host_ip = "127.0.0.1"  # the API server's advertised address (start() sets the host's)

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

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
        c.ports, c.pids, c.bin_dir = st["ports"], st["pids"], Path(st["bin_dir"])
        c.host_ip = st.get("host_ip", "127.0.0.1")
        if not all(pid_alive(p, c.bin_dir) for p in c.pids.values()):
            return None
        try:
            c._apiserver_ready()
        except Exception:  # noqa: BLE001
            return None
        return c

    def _write_state(self) -> None:
        self.state_file.write_text(json.dumps(
            {"ports": self.ports, "pids": self.pids, "bin_dir": str(self.bin_dir), "host_ip": self.host_ip},
            indent=2))

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
        (self.root / "kwok-stages.yaml").unlink(missing_ok=True)
        self.logs.mkdir(exist_ok=True)
        for old_log in self.logs.glob("*.log"):
            old_log.unlink()
        self.pki.mkdir()
        self.owned = True
        for name in ("etcd", "etcd_peer", "apiserver", "kcm", "scheduler", "kwok", "to_webhook",
                     "to_metrics", "to_health", "js_webhook", "js_health"):
            self.ports[name] = free_port()
        try:
            self.host_ip = host_ip()
            pki.cluster_pki(self.pki, self.host_ip)
            pki.write_kubeconfig(self.kubeconfig, self.server, self.pki)
            self._start_etcd(timeout)
            self._start_apiserver(timeout)
            self._start_controllers(timeout)
            self.start_kwok(timeout=timeout)
            self.create_nodes(nodes, gpus=gpus_per_node)
            self._start_training_operator(timeout)
            self._start_jobset(timeout)
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
        wait_for(lambda: self._check_alive("etcd") and http_ok(f"http://127.0.0.1:{p}/health"),
                 timeout, "etcd /health")

    def _apiserver_ready(self) -> bool:
        code, body = self._https_get(f"{self.server}/readyz")
        return code == 200

    def _start_apiserver(self, timeout: float) -> None:
        d = self.pki
        self._spawn("kube-apiserver", [
            self.bin("kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
            # On all addresses, advertised on the host's: the real node's pods reach it through
            # the `kubernetes` Service (10.96.0.1:443 -> this address), the kubelet's too.
            "--bind-address=0.0.0.0", f"--advertise-address={self.host_ip}",
            # `kubectl logs` / `exec` on the real node: the kubelet trusts the cluster CA.
            f"--kubelet-client-certificate={d / 'admin.crt'}", f"--kubelet-client-key={d / 'admin.key'}",
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
            "--kubelet-preferred-address-types=InternalIP,Hostname",
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

    def _start_training_operator(self, timeout: float) -> None:
        assert self.bin_dir is not None
        certs = pki.webhook_pki()
        crd = self.bin_dir / "manifests" / "kubeflow.org_pytorchjobs.yaml"
        self.kubectl("apply", "--server-side", "-f", str(crd))
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": pki.TO_NAMESPACE}})
        self.apply({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": pki.TO_SECRET, "namespace": pki.TO_NAMESPACE},
            "data": {n: pki.b64(certs / n) for n in ("ca.crt", "ca.key", "tls.crt", "tls.key")},
        })
        webhook_port = self.ports["to_webhook"]
        self.apply({
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": pki.TO_WEBHOOK_CONFIG},
            "webhooks": [{
                "name": "validator.pytorchjob.training-operator.kubeflow.org",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "clientConfig": {
                    "url": f"https://127.0.0.1:{webhook_port}/validate-kubeflow-org-v1-pytorchjob",
                    "caBundle": pki.b64(certs / "ca.crt"),
                },
                "rules": [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"],
                           "operations": ["CREATE", "UPDATE"], "resources": ["pytorchjobs"]}],
            }],
        })
        self.wait_established("pytorchjobs.kubeflow.org")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "MY_POD_NAMESPACE": pki.TO_NAMESPACE}
        self._spawn("training-operator", [
            self.bin("training-operator"),
            "--enable-scheme=pytorchjob",
            f"--metrics-bind-address=127.0.0.1:{self.ports['to_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{self.ports['to_health']}",
            f"--webhook-server-port={webhook_port}",
            f"--webhook-service-name={pki.TO_SERVICE}",
            f"--webhook-secret-name={pki.TO_SECRET}",
            "--leader-elect=false",
        ], env=env)
        wait_for(lambda: self._check_alive("training-operator")
                 and http_ok(f"http://127.0.0.1:{self.ports['to_health']}/readyz"),
                 timeout, "training-operator /readyz")

    def _start_jobset(self, timeout: float) -> None:
        """The JobSet controller (kubernetes-sigs/jobset) with its CRD and its admission
        webhooks (defaulting and validation of JobSets; the pod webhooks only for pods of a
        JobSet), served on 127.0.0.1 with the same CA-signed certificate as the
        training-operator's. Its own cert rotation is off (it would need an in-cluster
        Service)."""
        assert self.bin_dir is not None
        certs = pki.webhook_pki()
        manifests = self.bin_dir / "manifests" / "jobset"
        self.kubectl("apply", "--server-side", "-f", str(manifests / "jobset.x-k8s.io_jobsets.yaml"))
        port = self.ports["js_webhook"]
        only_jobset_pods = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}
        for doc in yaml.safe_load_all((manifests / "manifests.yaml").read_text()):
            if not doc:
                continue
            doc["metadata"] = {"name": f"jobset-{doc['kind'].removesuffix('WebhookConfiguration').lower()}"}
            for hook in doc["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": pki.b64(certs / "ca.crt")}
                hook["timeoutSeconds"] = 10
                if any("pods" in r["resources"] for r in hook["rules"]):
                    hook["objectSelector"] = only_jobset_pods
            self.apply(doc)
        config = self.root / "jobset-config.yaml"
        config.write_text(yaml.safe_dump({
            "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": port, "host": "127.0.0.1", "certDir": str(certs)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.ports['js_health']}"},
        }))
        self.wait_established("jobsets.jobset.x-k8s.io")
        self._spawn("jobset", [self.bin("jobset"), f"--config={config}", "--zap-log-level=info"],
                    env={**os.environ, "KUBECONFIG": str(self.kubeconfig)})
        wait_for(lambda: self._check_alive("jobset")
                 and http_ok(f"http://127.0.0.1:{self.ports['js_health']}/readyz"),
                 timeout, "jobset controller /readyz")

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
        pids = [st["pids"][n] for n in _stop_order(st.get("pids", {}))]
        terminate([p for p in pids if pid_alive(p, bin_dir)])
        state.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stop every process of this cluster (reverse start order); logs stay."""
        alive = [self.pids[n] for n in _stop_order(self.pids)
                 if (n in self.procs and self.procs[n].poll() is None)
                 or (n not in self.procs and self.bin_dir and pid_alive(self.pids[n], self.bin_dir))]
        terminate(alive)
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        self.procs.clear()
        self.pids.clear()
        self.state_file.unlink(missing_ok=True)
