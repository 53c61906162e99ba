"""Fake GPU nodes (kwok) and the chaos the tests inflict on them.

kwok plays the kubelet of every node annotated `kwok.x-k8s.io/node=<group>`: one kwok
process per group ("fake" is started with the cluster). It renews each node's Lease in
`kube-node-lease` as a kubelet does (`--node-lease-duration-seconds`), so the node
lifecycle controller keeps the nodes Ready for as long as the cluster runs; without it
every node went NotReady 40 s after it started. kwok also serves the kubelet's log endpoint:
every container's log is the file `pod-log.cri` in the state directory (a kwok ClusterLogs
rule; `append_pod_log` writes to it; `pod-log-previous.cri` the previous instance's), so
`kubectl logs` works, `--follow`, `--previous` and `--since` included; `kubectl exec` into a
pod named `EXEC_POD` runs the command here, in the state directory. Killing a
group's kwok process
(`lose_nodes`) is a lost node: no more Lease renewals, no pod status updates, and pods
deleted there stay Terminating, as on a real cluster whose kubelet is gone.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Iterable

import yaml

from .pki import make_cert
from .procs import free_port, terminate, wait_for

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
DEFAULT_GROUP = "fake"
KWOK_NODE_ANNOTATION = (KWOK_ANNOTATION, DEFAULT_GROUP)
GPU_RESOURCE = "nvidia.com/gpu"
NODE_LEASE_SECONDS = 40  # the kubelet's default nodeLeaseDurationSeconds; renewed every 10 s

# Chaos and request labels/annotations understood by the kwok stages loaded here.
# Pod failure: kwok's own chaos stage `pod-container-running-failed`.
FAIL_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"
FAIL_ANNOTATION_PREFIX = "pod-container-running-failed.stage.kwok.x-k8s.io/"
# Node NotReady: kwok's own chaos stage `node-not-ready`.
NOT_READY_LABEL = "node-not-ready.stage.kwok.x-k8s.io"
# Pod completion on request: a stage of ours (below); any Running pod with this label
# ends as Succeeded with exit code 0 in every container.
COMPLETE_LABEL = "stage.rlhf.dev/complete"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"

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


POD_LOG = "pod-log.cri"
"""What every container of a fake node logs (CRI log format, as a kubelet reads it)."""
PREVIOUS_POD_LOG = "pod-log-previous.cri"
"""What every container's previous instance logged (`kubectl logs --previous`)."""
EXEC_POD = "kept-trainer-master-0"
"""The one pod name (in any namespace) whose `kubectl exec` kwok runs, as a local command in
the state directory on this host (a kwok ClusterExec): a job named `kept` reads files there."""


class FakeNodes:
    """Mixin of `Cluster`: kwok processes, fake nodes, and chaos."""

    def append_pod_log(self, *lines: str, at: datetime | None = None, previous: bool = False) -> None:
        """Lines every container's log ends with from now on (kwok reads the file on each request),
        stamped `at` (default now); `previous`: the log of every container's previous instance."""
        now = (at or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        with open(self.root / (PREVIOUS_POD_LOG if previous else POD_LOG), "a") as fh:
            fh.writelines(f"{now} stdout F {line}\n" for line in lines)

    def _kwok_exec(self) -> str:
        return yaml.safe_dump({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterExec",
                               "metadata": {"name": "kept-trainer"},
                               "spec": {"selector": {"matchNames": [EXEC_POD]},
                                        "execs": [{"local": {"workDir": str(self.root)}}]}}, sort_keys=False)

    def _kwok_logs(self) -> str:
        return yaml.safe_dump({"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterLogs",
                               "metadata": {"name": "every-container"},
                               "spec": {"logs": [{"logsFile": str(self.root / POD_LOG), "follow": True,
                                                  "previousLogsFile": str(self.root / PREVIOUS_POD_LOG)}]}},
                              sort_keys=False)

    def _kwok_stages(self) -> str:
        docs = []
        for path in sorted((self.bin_dir / "manifests" / "kwok-stages").glob("*.yaml")):
            stage = yaml.safe_load(path.read_text())
            if stage["metadata"]["name"] == "pod-complete":
                # kwok completes every Job's pod at once; a JobSet's trainer and servers run
                # until a test ends them (complete_pod, fail_pod), as real ones do.
                stage["spec"]["selector"]["matchExpressions"].append(
                    {"key": f'.metadata.labels["{JOBSET_NAME_LABEL}"]', "operator": "DoesNotExist"})
            docs.append(yaml.safe_dump(stage, sort_keys=False))
        docs.append(COMPLETE_STAGE)
        docs.append(self._kwok_logs())
        docs.append(self._kwok_exec())
        return "\n---\n".join(d.strip("\n").removeprefix("---\n") for d in docs) + "\n"

    def start_kwok(self, group: str = DEFAULT_GROUP, timeout: float = 60) -> str:
        """Start the kwok process that plays the kubelet of the nodes of `group`."""
        name = "kwok" if group == DEFAULT_GROUP else f"kwok-{group}"
        port_key = name.replace("-", "_")
        if port_key not in self.ports:
            self.ports[port_key] = free_port()
        cfg = self.root / "kwok-stages.yaml"
        cfg.write_text(self._kwok_stages())  # the same every time (a state directory of an older harness gets the logs)
        if not (self.root / POD_LOG).exists():
            self.append_pod_log("a container of a kwok node started")
        if not (self.root / PREVIOUS_POD_LOG).exists():
            self.append_pod_log("the previous instance of a container of a kwok node", previous=True)
        if not (self.pki / "kwok.crt").exists():
            make_cert(self.pki, "kwok", "ca", "/CN=kwok", ["subjectAltName=IP:127.0.0.1", "extendedKeyUsage=serverAuth",
                                                           "keyUsage=critical,digitalSignature,keyEncipherment"])
        # Each group its own pod CIDR so that two kwok processes hand out distinct pod IPs.
        index = 0 if group == DEFAULT_GROUP else 1 + sum(n.startswith("kwok-") for n in self.pids)
        port = self.ports[port_key]
        # The nodes' address is this kwok's HTTPS server, as a kubelet's is its own: the API
        # server reaches it for `kubectl logs` (it does not verify a kubelet's certificate
        # unless --kubelet-certificate-authority is given).
        self._spawn(name, [
            self.bin("kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={cfg}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}={group}",
            f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
            f"--server-address=127.0.0.1:{port}", f"--node-ip=127.0.0.1", f"--node-port={port}",
            f"--tls-cert-file={self.pki / 'kwok.crt'}", f"--tls-private-key-file={self.pki / 'kwok.key'}",
            f"--cidr=10.{244 + index}.0.1/16",
        ])
        wait_for(lambda: self._check_alive(name) and self._https_get(f"https://127.0.0.1:{port}/healthz",
                                                                     client_cert=False, verify=False)[0] == 200,
                 timeout, f"{name} /healthz")
        return name

    def create_nodes(self, count: int, prefix: str = "kwok-node", gpus: int = 8, cpu: str = "64",
                     memory: str = "512Gi", labels: dict[str, str] | None = None,
                     start: int | None = None, group: str = DEFAULT_GROUP) -> list[str]:
        """Create `count` fake nodes that kwok (the process of `group`) manages, each with
        `nvidia.com/gpu: gpus`."""
        if start is None:
            taken = {n["metadata"]["name"] for n in self.get("nodes")["items"]}
            start = 0
            while f"{prefix}-{start}" in taken:
                start += 1
        names = [f"{prefix}-{i}" for i in range(start, start + count)]
        if not names:
            return []
        capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "1Ti"}
        if gpus:
            capacity[GPU_RESOURCE] = str(gpus)
        nodes = [{
            "apiVersion": "v1", "kind": "Node",
            "metadata": {
                "name": n,
                "annotations": {KWOK_ANNOTATION: group, "node.alpha.kubernetes.io/ttl": "0"},
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

    def lose_nodes(self, group: str) -> list[str]:
        """Lose every node of `group`: stop its kwok process (its kubelet), then mark the
        nodes' conditions Unknown as the node lifecycle controller does once their Leases
        are older than --node-monitor-grace-period (here at once, not 50 s later)."""
        name = f"kwok-{group}"
        terminate([self.pids.pop(name)])
        self.procs.pop(name, None)
        self._write_state()
        nodes = [n for n in self.get("nodes")["items"]
                 if (n["metadata"].get("annotations") or {}).get(KWOK_ANNOTATION) == group]
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        for n in nodes:
            conds = [{**c, "status": "Unknown", "reason": "NodeStatusUnknown",
                      "message": "Kubelet stopped posting node status.", "lastTransitionTime": now}
                     for c in n["status"].get("conditions", [])]
            self.kubectl("patch", "node", n["metadata"]["name"], "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"conditions": conds}}))
        return [n["metadata"]["name"] for n in nodes]

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
