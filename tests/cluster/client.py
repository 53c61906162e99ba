"""Talking to a test cluster: kubectl, helm, server-side apply of dicts, the Python client.
`KubeClient` is the part of `Cluster` that needs only the state directory and the binaries."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import yaml

from .procs import ClusterError


class KubeClient:
    root: Path
    bin_dir: Path | None

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

    # ---- kubectl / helm
    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.bin("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
                              input=input, capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def wait_established(self, crd: str, timeout_s: float = 60) -> None:
        """Wait until a CRD serves. `kubectl wait` fails at once (".status.conditions
        accessor error") when it reads the CRD before the API server wrote any condition:
        that answer is retried, any other failure raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = max(int(deadline - time.monotonic()), 1)
            proc = self.kubectl("wait", "--for=condition=Established", f"--timeout={left}s", f"crd/{crd}",
                                check=False)
            if proc.returncode == 0:
                return
            if "accessor error" not in proc.stderr or time.monotonic() > deadline:
                raise ClusterError(f"crd/{crd} not Established ({proc.returncode}):\n{proc.stderr}")
            time.sleep(0.2)

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

    def pod_phase(self, namespace: str, name: str) -> str | None:
        proc = self.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}",
                            check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def api_client(self):
        """A `kubernetes.client.ApiClient` for this cluster (needs the kubernetes package)."""
        from kubernetes import config as kconfig

        return kconfig.new_client_from_config(config_file=str(self.kubeconfig))
