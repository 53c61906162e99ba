"""A real node for the test cluster: containerd + runc + CNI plugins (Debian's packages,
unpacked by tests/cluster/node/build.sh), the kubelet and kube-proxy from the control
plane's own Kubernetes module, and CoreDNS, all as host processes. Pods scheduled to it are
real containers; pulls come from the suite's registry (tests/cluster/registry.py).

The node carries the taint `rlhf.dev/real-node=true:NoSchedule`, so only pods that tolerate
it run for real; everything else keeps landing on kwok's fake GPU nodes.

What it changes on the host, and undoes on `stop()` (docs/testing.md lists why each is
needed): sysctls the kubelet sets (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops)
and ip_forward; iptables chains (KUBE-*, CNI-*); the `cni0` bridge; mounts under its own
directories; cgroups under `/rlhf-node` in every v1 hierarchy. Fixed host paths the kubelet
hardcodes: /var/log/pods, /var/log/containers, /var/lib/kubelet/device-plugins; so one real
node per host (a lock file).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from .procs import ClusterError, free_port, wait_for

NODE_NAME = "real-node-0"
TAINT_KEY = "rlhf.dev/real-node"
NODE_LABEL = "rlhf.dev/real-node"
TOLERATION = {"key": TAINT_KEY, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
SELECTOR = {NODE_LABEL: "true"}
POD_CIDR = "10.244.0.0/24"
CGROUP_ROOT = "rlhf-node"
STATE = Path(os.environ.get("RLHF_NODE_STATE", "/var/lib/rlhf-test-node"))
RUN = Path("/run/rlhf-test-node")
# containerd's image store survives sessions (a warm run pulls nothing).
CONTAINERD_ROOT = Path.home() / ".cache" / "rlhf-operator" / "containerd-root"
SYSCTL_FILE = STATE / "host-sysctls.json"
SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")


def _sh(*args: str, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, env=env)


class RealNode:
    def __init__(self, cluster, tools: Path, registry_host: str, pause_image: str):
        self.c = cluster
        self.tools = tools
        self.debs = tools / "debs"
        self.registry_host = registry_host
        self.pause_image = pause_image
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = Path(cluster.logs)
        self.ip = cluster.host_ip
        self.ports = {k: free_port() for k in ("kubelet", "kubelet_healthz", "proxy_metrics", "proxy_healthz")}
        self.path = f"{tools / 'bin'}:{self.debs / 'usr' / 'bin'}:{self.debs / 'usr' / 'sbin'}:{os.environ['PATH']}"
        self.env = {**os.environ, "PATH": self.path}
        self._lock = None

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 120) -> "RealNode":
        if os.geteuid() != 0:
            raise ClusterError("the real node needs root (containerd, runc, iptables)")
        if self.ip == "127.0.0.1":
            raise ClusterError("the real node needs a host address besides loopback (pods reach the API there)")
        STATE.mkdir(parents=True, exist_ok=True)
        self._lock = open(STATE / ".lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise ClusterError(f"another real node runs on this host ({STATE}/.lock)") from exc
        self._cleanup_host()  # what a killed session left behind (its sysctls restored too)
        # The host's own values, kept on disk until stop() puts them back: a session killed
        # before its stop() leaves them for the next start to restore.
        saved = {}
        for key in SYSCTLS:
            with contextlib.suppress(OSError):
                saved[key] = Path("/proc/sys", key).read_text().strip()
        SYSCTL_FILE.write_text(json.dumps(saved))
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        try:
            self._cgroups()
            self._start_containerd(timeout)
            self._start_coredns(timeout)
            self._start_kubelet(timeout)
            self._start_kube_proxy(timeout)
        except BaseException:
            tails = "\n".join(self.c.log_tail(n, 40) for n in self.procs)
            self.stop()
            raise ClusterError(f"real node failed to start\n{tails}")
        return self

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        log.write(f"\n==== {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
        log.flush()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def _alive(self, name: str) -> bool:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise ClusterError(f"{name} exited with {proc.returncode}\n{self.c.log_tail(name, 60)}")
        return True

    def _cgroups(self) -> None:
        """`/rlhf-node` in every v1 hierarchy, the kubelet's cgroupRoot (cpuset needs its cpus
        and mems copied from the parent before anything can join)."""
        base = Path("/sys/fs/cgroup")
        for h in base.iterdir():
            if not h.is_dir() or h.is_symlink() or h.name == "unified":
                continue
            d = h / CGROUP_ROOT
            d.mkdir(exist_ok=True)
            if h.name == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((h / f).read_text())

    def _start_containerd(self, timeout: float) -> None:
        RUN.mkdir(parents=True, exist_ok=True)
        CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
        cni_conf = RUN / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-rlhf.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": "rlhf-test",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(RUN / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }))
        self.sock = RUN / "containerd.sock"
        reg = self.registry_host
        config = f"""version = 2
root = "{CONTAINERD_ROOT}"
state = "{RUN / 'containerd'}"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{RUN / 'containerd.sock.ttrpc'}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{STATE / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.pause_image}"
  # Root here lacks CAP_SYS_RESOURCE: lowering oom_score_adj below ours is refused, and
  # every sandbox failed ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    # the compressed layers go once unpacked: the images are several GB and the disk shared
    discard_unpacked_layers = true
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{self.debs / 'usr' / 'sbin' / 'runc'}"
        Root = "{RUN / 'runc'}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{self.debs / 'usr' / 'lib' / 'cni'}"
    conf_dir = "{cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."{reg}"]
    endpoint = ["http://{reg}"]
"""
        (RUN / "containerd.toml").write_text(config)
        self._spawn("containerd", [str(self.debs / "usr" / "bin" / "containerd"), "--config",
                                   str(RUN / "containerd.toml"), "--log-level", "warn"])
        wait_for(lambda: self._alive("containerd") and self.sock.exists()
                 and self.ctr("version").returncode == 0, timeout, "containerd")

    def keep_only_images(self, digests: set[str]) -> list[str]:
        """Remove from containerd's store every image whose manifest digest is not in `digests`
        (earlier builds' images: the store survives sessions, the kubelet's image GC is off and
        each trainer or vLLM image is GBs). containerd's GC then frees their snapshots.
        Returns the names removed."""
        listing = self.ctr("images", "ls")
        gone = []
        for line in listing.stdout.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 3 and cols[2] not in digests:
                gone.append(cols[0])
        for i in range(0, len(gone), 50):
            self.ctr("images", "rm", *gone[i:i + 50])
        return gone

    def report(self, namespaces: list[str]) -> str:
        """What a failed real-pod test needs to say why: the node's conditions and taints, each
        pod's phase, reason and container states, the namespaces' events, the disk's free space,
        and the kubelet's and containerd's last warnings."""
        out = []
        node = self.c.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
        if node.returncode == 0:
            n = json.loads(node.stdout)
            out.append("node conditions: " + "; ".join(
                f"{c['type']}={c['status']} ({c.get('reason', '')})" for c in n["status"].get("conditions", [])))
            out.append(f"node taints: {n['spec'].get('taints')}")
        for ns in namespaces:
            pods = self.c.kubectl("get", "pods", "-n", ns, "-o", "json", check=False)
            for p in json.loads(pods.stdout)["items"] if pods.returncode == 0 else []:
                st = p["status"]
                out.append(f"pod {ns}/{p['metadata']['name']}: {st.get('phase')} reason={st.get('reason')} "
                           f"message={st.get('message')} containers="
                           + json.dumps([{"name": c["name"], "state": c.get("state"), "last": c.get("lastState")}
                                         for c in st.get("containerStatuses", []) + st.get("initContainerStatuses", [])]))
            ev = self.c.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False).stdout
            out.append(f"events in {ns}:\n" + "\n".join(ev.splitlines()[-25:]))
        df = _sh("df", "-h", str(CONTAINERD_ROOT), str(STATE)).stdout
        out.append(f"disk:\n{df}")
        for name in ("kubelet", "containerd"):
            path = self.logs / f"{name}.log"
            if path.exists():
                lines = [ln for ln in path.read_text(errors="replace").splitlines()
                         if (ln[:1] in ("E", "W") or "level=error" in ln)
                         and "code = NotFound" not in ln]  # containers already removed: noise
                out.append(f"{name} errors and warnings (last 12):\n" + "\n".join(ln[:400] for ln in lines[-12:]))
        return "\n".join(out)

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        return _sh(str(self.debs / "usr" / "bin" / "ctr"), "--address", str(self.sock), "-n", "k8s.io", *args,
                   env=self.env)

    def _start_coredns(self, timeout: float) -> None:
        corefile = RUN / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {self.ip}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.c.kubeconfig} rlhf-test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
        self._spawn("coredns", [str(self.tools / "bin" / "coredns"), "-conf", str(corefile)])
        wait_for(lambda: self._alive("coredns") and _tcp_open(self.ip, 53), timeout, "coredns")

    def _start_kubelet(self, timeout: float) -> None:
        root = STATE / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        for d in ("/var/log/pods", "/var/log/containers", "/var/lib/kubelet/device-plugins"):
            Path(d).mkdir(parents=True, exist_ok=True)
        cfg = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "0.0.0.0", "port": self.ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.ports["kubelet_healthz"],
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.c.pki / "ca.crt")}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{CGROUP_ROOT}", "failCgroupV1": False,
            "failSwapOn": False, "clusterDNS": [self.ip], "clusterDomain": "cluster.local",
            "resolvConf": "/etc/resolv.conf",
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
            # No evictions: the node is the host, shared with the rest of the suite, whose page
            # cache and other tests' files move the kubelet's memory and disk signals. CI once had
            # its pods evicted mid-run (phase Failed, no log) by thresholds meant for a real node.
            "evictionHard": {},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False, "rotateCertificates": False, "protectKernelDefaults": False,
            "podPidsLimit": 4096, "maxPods": 60,
            "syncFrequency": "10s", "fileCheckFrequency": "20s", "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
        }
        (RUN / "kubelet.yaml").write_text(yaml.safe_dump(cfg))
        # A Node object a killed session left still reads Ready: wait for this kubelet's own.
        self.c.kubectl("delete", "node", NODE_NAME, "--ignore-not-found", "--wait=true", check=False)
        self._spawn("kubelet", [
            self.c.bin("kubelet"), f"--config={RUN / 'kubelet.yaml'}", f"--kubeconfig={self.c.kubeconfig}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={self.ip}", f"--root-dir={root}",
            f"--cert-dir={STATE / 'kubelet-pki'}", f"--node-labels={NODE_LABEL}=true", "--v=1",
        ])
        wait_for(lambda: self._alive("kubelet") and self.c.node_ready(NODE_NAME), timeout, f"node {NODE_NAME} Ready")

    def _start_kube_proxy(self, timeout: float) -> None:
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.c.kubeconfig)},
            "mode": "iptables", "hostnameOverride": NODE_NAME, "bindAddress": "0.0.0.0",
            "clusterCIDR": POD_CIDR,
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
            # Leave the host's conntrack limits alone.
            "conntrack": {"maxPerCore": 0, "min": 0},
            "metricsBindAddress": f"127.0.0.1:{self.ports['proxy_metrics']}",
            "healthzBindAddress": f"127.0.0.1:{self.ports['proxy_healthz']}",
        }
        (RUN / "kube-proxy.yaml").write_text(yaml.safe_dump(cfg))
        self._spawn("kube-proxy", [self.c.bin("kube-proxy"), f"--config={RUN / 'kube-proxy.yaml'}", "--v=1"])
        wait_for(lambda: self._alive("kube-proxy")
                 and "KUBE-SERVICES" in _sh("iptables-save", "-t", "nat", env=self.env).stdout,
                 timeout, "kube-proxy's rules")

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        # Pods first, through the API (their volumes unmounted by the kubelet), then the rest.
        with contextlib.suppress(Exception):
            if "kubelet" in self.procs and self.procs["kubelet"].poll() is None:
                self.c.kubectl("delete", "pods", "--all-namespaces", "--field-selector",
                               f"spec.nodeName={NODE_NAME}", "--grace-period=1", "--wait=false", check=False)
                wait_for(lambda: not self.c.kubectl("get", "pods", "-A", "--field-selector",
                                                    f"spec.nodeName={NODE_NAME}", "-o", "name",
                                                    check=False).stdout.strip(), 60, "the node's pods gone")
        for name in ("kube-proxy", "kubelet", "coredns"):
            self._terminate(name)
        self._kill_containers()
        self._terminate("containerd")
        with contextlib.suppress(Exception):
            self.c.kubectl("delete", "node", NODE_NAME, "--wait=false", check=False)
        self._cleanup_host()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _terminate(self, name: str, grace: float = 15) -> None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def _kill_containers(self) -> None:
        """Every container runc still runs under our root, then the shims."""
        runc = str(self.debs / "usr" / "sbin" / "runc")
        root = RUN / "runc"
        for ns_root in (root.iterdir() if root.exists() else []):
            out = _sh(runc, "--root", str(ns_root), "list", "-q").stdout.split()
            for cid in out:
                _sh(runc, "--root", str(ns_root), "kill", "--all", cid, "KILL")
            for cid in out:
                _sh(runc, "--root", str(ns_root), "delete", "--force", cid)
        for pid in _pids_with_cmdline(str(RUN)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _cleanup_host(self) -> None:
        """Undo what a node leaves on the host (also run before a start: a killed session
        leaves all of it)."""
        for pid in _pids_with_cmdline(str(RUN)):  # shims and their containers
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        prefixes = tuple(str(p) for p in (STATE, RUN, CONTAINERD_ROOT))
        for _ in range(3):
            mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
            ours = sorted((m for m in mounts if m.startswith(prefixes)), key=len, reverse=True)
            if not ours:
                break
            for m in ours:
                _sh("umount", "-l", m)
        self._remove_cgroups()
        self._iptables_cleanup()
        if Path("/sys/class/net/cni0").exists():
            _sh("ip", "link", "delete", "cni0")
        shutil.rmtree(RUN, ignore_errors=True)
        shutil.rmtree(STATE / "kubelet", ignore_errors=True)
        if SYSCTL_FILE.exists():
            for key, value in json.loads(SYSCTL_FILE.read_text()).items():
                with contextlib.suppress(OSError):
                    Path("/proc/sys", key).write_text(value)
            SYSCTL_FILE.unlink()

    def _remove_cgroups(self) -> None:
        for h in Path("/sys/fs/cgroup").iterdir():
            top = h / CGROUP_ROOT
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()

    def _iptables_cleanup(self) -> None:
        """Remove the KUBE-* and CNI-* chains and every rule that jumps to them."""
        for cmd in ("iptables", "ip6tables"):
            for table in ("filter", "nat", "mangle"):
                rules = _sh(cmd, "-t", table, "-S", env=self.env).stdout.splitlines()
                ours = lambda name: name.startswith(("KUBE-", "CNI-"))  # noqa: E731
                for rule in rules:
                    parts = shlex.split(rule)  # comments are quoted
                    if parts[:1] == ["-A"] and not ours(parts[1]) and "-j" in parts \
                            and ours(parts[parts.index("-j") + 1]):
                        _sh(cmd, "-t", table, "-D", *parts[1:], env=self.env)
                chains = [r.split()[1] for r in rules if r.startswith("-N ") and ours(r.split()[1])]
                for chain in chains:
                    _sh(cmd, "-t", table, "-F", chain, env=self.env)
                for chain in chains:
                    _sh(cmd, "-t", table, "-X", chain, env=self.env)


def _tcp_open(host: str, port: int) -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _pids_with_cmdline(fragment: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if fragment in p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(p.name))
    return pids
