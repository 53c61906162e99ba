"""The operator at scale on the test control plane (tests/cluster): N RLHFJobs on M fake
8-GPU nodes (kwok), one `rlhfctl operator` process.

Measures, with the clocks of this process:
- create -> children: from the moment the N jobs are created until every job has all nine
  children (config, service account, role, binding, two services, network policy,
  StatefulSet, PyTorchJob), and until every job is Running (all pods Running and Ready);
- event -> status: for K running jobs, a trainer pod is failed (kwok's chaos stage); the
  latency from this process's pod watch seeing the failed pod to its RLHFJob watch seeing
  the job Restarting (watch delivery on both ends, the operator's queue, reconcile and
  status patch in between). p50 / p90 / max.
Also prints the operator's reconciles and CPU seconds, which say what limits the figures,
and the reads only reconciles make, from the API server's request counters (per second:
over the whole run, from creating the jobs to the last restart seen).

    python bench/operator_scale.py [--jobs 100 --nodes 200 --failures 50]
    python bench/operator_scale.py --dir .cluster   # attach to a running `make cluster`

Each job: 2 rollout servers x 1 GPU + 1 trainer pod x 2 GPUs. `--backend JobSet` runs the
same jobs as JobSets (the JobSet controller restarts them: the latency then also holds the
Job controller failing the Job and the JobSet controller recreating its Jobs). `--backend
TrainJob` runs the trainers as Kubeflow Trainer v2 TrainJobs (its controller started here,
tests/cluster/trainer_v2.py; `make trainer-bin` first); their pods carry the job's labels from the runtime patch (Trainer v2.3).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from cluster.harness import Cluster, ensure_binaries, free_port, wait_for  # noqa: E402

CHILDREN = {"PyTorchJob": "configmap,serviceaccount,role,rolebinding,service,networkpolicy,statefulset,pytorchjob",
            "JobSet": "configmap,serviceaccount,role,rolebinding,service,networkpolicy,jobset",
            "TrainJob": "configmap,serviceaccount,role,rolebinding,service,networkpolicy,statefulset,trainjob"}
CHILDREN_PER_JOB = {"PyTorchJob": 9, "JobSet": 7, "TrainJob": 9}


def job_doc(name: str, backend: str = "PyTorchJob") -> dict:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name},
            "spec": {"backend": backend, "model": {"path": "/work/models/tiny"},
                     "data": {"path": "/work/data/train.jsonl"},
                     "rollout": {"replicas": 2, "image": "example.invalid/vllm:1"},
                     "trainer": {"numNodes": 1, "nprocPerNode": 2, "image": "example.invalid/trainer:1"},
                     # model, data and output on a mounted volume, or the operator refuses the job
                     # (one mount: a TrainJob lists a container's mounts by volume name)
                     "pod": {"volumes": [{"name": "work", "emptyDir": {}}],
                             "volumeMounts": [{"name": "work", "mountPath": "/work"}]},
                     "output": {"dir": "/work/output"},
                     "schedule": {"promptsPerStep": 8}, "runPolicy": {"maxRestarts": 3}}}


class Watcher:
    """Two watches (pods with the job label, RLHFJobs) recording when things are first seen."""

    def __init__(self, cluster: Cluster, ns: str):
        from kubernetes import client, watch

        self.api = cluster.api_client()
        self.core, self.custom, self.watch = client.CoreV1Api(self.api), client.CustomObjectsApi(self.api), watch
        self.ns = ns
        self.lock = threading.Lock()
        self.phase: dict[str, str] = {}
        self.pod_failed_at: dict[str, float] = {}  # job -> first failed trainer pod seen
        self.trainer_pod: dict[str, str] = {}  # job -> name of a Running trainer pod
        self.restarting_at: dict[str, float] = {}  # job -> first seen Restarting / restarts >= 1
        self.stop = threading.Event()
        for target in (self._jobs, self._pods):
            threading.Thread(target=target, daemon=True).start()

    def _stream(self, fn, **kw):
        while not self.stop.is_set():
            try:
                for ev in self.watch.Watch().stream(fn, timeout_seconds=60, **kw):
                    yield ev
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - re-watch
                time.sleep(0.2)

    def _jobs(self):
        for ev in self._stream(self.custom.list_namespaced_custom_object, group="rlhf.dev", version="v1alpha1",
                               namespace=self.ns, plural="rlhfjobs"):
            obj, now = ev["object"], time.monotonic()
            st = obj.get("status") or {}
            name = obj["metadata"]["name"]
            with self.lock:
                self.phase[name] = st.get("phase", "")
                if (st.get("phase") == "Restarting" or (st.get("restarts") or 0) >= 1) and name not in self.restarting_at:
                    self.restarting_at[name] = now

    def _pods(self):
        for ev in self._stream(self.core.list_namespaced_pod, namespace=self.ns, label_selector="rlhf.dev/role=trainer"):
            pod, now = ev["object"], time.monotonic()
            job = pod.metadata.labels.get("rlhf.dev/job")
            statuses = pod.status.container_statuses or []
            failed = pod.status.phase == "Failed" or any(
                cs.state and cs.state.terminated and cs.state.terminated.exit_code for cs in statuses)
            with self.lock:
                if failed and job not in self.pod_failed_at:
                    self.pod_failed_at[job] = now
                if pod.status.phase == "Running" and not failed and not pod.metadata.deletion_timestamp:
                    self.trainer_pod.setdefault(job, pod.metadata.name)


# Reads that only the operator's reconciles make: the controllers and kwok read through
# LIST + WATCH informers, this script through watches (counted as WATCH).
RECONCILE_READS = ("GET rlhfjobs", "GET statefulsets", "GET pytorchjobs", "GET jobsets", "LIST pods", "GET nodes")


# Writes: the operator's applies (PATCH), status patches, deletes and events, and the
# controllers' and kwok's writes (pods' status, the workloads' status): what the API server
# spends its CPU on while the jobs are created (verb, resource, subresource).
WRITE_VERBS = ("POST", "PATCH", "PUT", "DELETE", "APPLY")


def api_requests(cluster: Cluster) -> dict[str, float]:
    """The API server's own request counters (`apiserver_request_total`): RECONCILE_READS, and
    every write by verb and resource ("PATCH rlhfjobs/status"); and, under "<key> seconds",
    the time the API server spent on them (`apiserver_request_duration_seconds_sum`)."""
    out = dict.fromkeys(RECONCILE_READS, 0.0)
    for line in cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout.splitlines():
        metric = line.split("{", 1)[0]
        if metric not in ("apiserver_request_total", "apiserver_request_duration_seconds_sum"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        key = f"{labels.get('verb')} {labels.get('resource')}"
        if labels.get("verb") in WRITE_VERBS:
            key += f"/{labels['subresource']}" if labels.get("subresource") else ""
        elif key not in RECONCILE_READS:
            continue
        key += " seconds" if metric.endswith("_sum") else ""
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--failures", type=int, default=50, help="jobs whose trainer pod is failed (latency samples)")
    ap.add_argument("--dir", help="attach to the cluster running in this state directory (else start one)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--workers", type=int, default=None, help="operator reconcile workers (default: its own)")
    ap.add_argument("--backend", choices=("PyTorchJob", "JobSet", "TrainJob"), default="PyTorchJob")
    args = ap.parse_args()

    own = None
    if args.dir:
        cluster = Cluster.attach(args.dir)
        if cluster is None:
            sys.exit(f"no cluster running in {args.dir}")
    else:
        own = cluster = Cluster(Path(tempfile.mkdtemp(prefix="rlhf-bench-")), bin_dir=ensure_binaries())
        t = time.monotonic()
        cluster.start(nodes=0)
        print(f"control plane up in {time.monotonic() - t:.1f} s")
    try:
        if args.backend != "TrainJob":
            return run(cluster, args)
        from cluster import trainer_v2

        if (bin_dir := trainer_v2.built()) is None:
            sys.exit("Kubeflow Trainer v2 is not built: make trainer-bin")
        with trainer_v2.trainer_controller(cluster, bin_dir, Path(tempfile.mkdtemp(prefix="rlhf-bench-trainer-"))):
            return run(cluster, args)
    finally:
        if own is not None:
            own.stop()


def run(cluster: Cluster, args) -> int:
    have = sum(n["metadata"]["name"].startswith("bench-node-") for n in cluster.get("nodes")["items"])
    if have < args.nodes:
        t = time.monotonic()
        cluster.create_nodes(args.nodes - have, prefix="bench-node", start=have)
        cluster.wait_nodes_ready(timeout=300)
        print(f"{args.nodes} fake 8-GPU nodes Ready in {time.monotonic() - t:.1f} s")
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / "rlhfjobs.yaml"))
    # a CRD just applied may have no status yet: `kubectl wait` refuses that instead of waiting
    wait_for(lambda: cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/rlhfjobs.rlhf.dev",
                                     check=False).returncode == 0, 90, "the RLHFJob CRD Established", interval=1)
    ns = f"bench-{os.getpid()}"
    cluster.kubectl("create", "namespace", ns)
    log = Path(tempfile.mkdtemp(prefix="rlhf-bench-op-")) / "operator.log"
    port = free_port()
    env = {**cluster.env, **({"RLHF_OPERATOR_WORKERS": str(args.workers)} if args.workers else {}), "PYTHONPATH": os.pathsep.join(
        [str(REPO / p) for p in ("contract", "operator", "launcher")] + [os.environ.get("PYTHONPATH", "")])}
    with open(log, "ab") as fh:
        op = subprocess.Popen([sys.executable, "-m", "rlhf_launcher.cli", "operator", "--namespace", ns,
                               "--lease-namespace", ns, "--metrics-port", str(port)],
                              stdout=fh, stderr=subprocess.STDOUT, env=env)
    watcher = Watcher(cluster, ns)
    try:
        wait_for(lambda: "leader:" in log.read_text(), 60, "the operator to lead")
        cpu0, reads0 = cpu_seconds(op.pid), api_requests(cluster)
        names = [f"job-{i:04d}" for i in range(args.jobs)]
        docs = yaml.safe_dump_all([job_doc(n, args.backend) for n in names])
        t0 = time.monotonic()
        cluster.kubectl("create", "-n", ns, "-f", "-", input=docs, timeout=300)
        created = time.monotonic() - t0

        def all_children() -> bool:
            out = cluster.kubectl("get", CHILDREN[args.backend], "-n", ns, "-l", "rlhf.dev/job", "-o", "name",
                                  timeout=120).stdout
            return len(out.split()) >= CHILDREN_PER_JOB[args.backend] * args.jobs
        wait_for(all_children, args.timeout, "every job's children", interval=0.5)
        t_children = time.monotonic() - t0

        def all_running() -> bool:
            with watcher.lock:
                return sum(watcher.phase.get(n) == "Running" for n in names) == args.jobs
        wait_for(all_running, args.timeout, "every job Running", interval=0.5)
        t_running = time.monotonic() - t0
        cpu_create = cpu_seconds(op.pid) - cpu0

        # Event -> status: fail one trainer pod in each of K jobs, 0.1 s apart.
        sample = names[: args.failures]
        cpu1 = cpu_seconds(op.pid)
        for n in sample:
            with watcher.lock:
                victim = watcher.trainer_pod[n]
            cluster.fail_pod(ns, victim, exit_code=137, reason="OOMKilled")
            time.sleep(0.1)

        def seen() -> bool:
            with watcher.lock:
                return all(n in watcher.restarting_at and n in watcher.pod_failed_at for n in sample)
        wait_for(seen, args.timeout, "every failed job Restarting", interval=0.5)
        with watcher.lock:
            lat = [watcher.restarting_at[n] - watcher.pod_failed_at[n] for n in sample]
        cpu_fail = cpu_seconds(op.pid) - cpu1
        t_all = time.monotonic() - t0
        requests = {k: v - reads0.get(k, 0.0) for k, v in api_requests(cluster).items()}
        reads = {k: requests[k] for k in RECONCILE_READS}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        def metric(prefix: str) -> float:
            return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))
        reconciles = metric("rlhf_operator_reconciles_total{")
        mean_reconcile = metric("rlhf_operator_reconcile_duration_seconds_sum") / max(
            1.0, metric("rlhf_operator_reconcile_duration_seconds_count"))
        print(json.dumps({
            "backend": args.backend, "jobs": args.jobs, "nodes": args.nodes, "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "create_call_s": round(created, 2),
            "all_children_s": round(t_children, 2),
            "all_running_s": round(t_running, 2),
            "operator_cpu_s_until_running": round(cpu_create, 1),
            "event_to_status_s": {"samples": len(lat), "p50": round(statistics.median(lat), 3),
                                  "p90": round(percentile(lat, 0.9), 3), "max": round(max(lat), 3)},
            "operator_cpu_s_during_failures": round(cpu_fail, 1),
            "reconciles_total": int(reconciles),
            "reconcile_mean_s": round(mean_reconcile, 3),
            "child_reads": {s: int(metric(f'rlhf_operator_child_reads_total{{source="{s}"}}')) for s in ("index", "api")},
            "api_reads": {k: int(v) for k, v in reads.items() if v},
            "api_reads_per_s": round(sum(reads.values()) / t_all, 1),
            "api_writes": {k: int(v) for k, v in sorted(requests.items())
                           if v >= 1 and k not in reads and not k.endswith(" seconds")},
            # what one request of each kind cost the API server (its own clock), milliseconds
            "api_mean_ms": {k: round(1000 * requests[f"{k} seconds"] / v, 1) for k, v in sorted(requests.items())
                            if v >= 1 and f"{k} seconds" in requests},
        }, indent=2))
        return 0
    finally:
        watcher.stop.set()
        op.terminate()
        try:
            op.wait(timeout=15)
        except subprocess.TimeoutExpired:
            op.kill()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


if __name__ == "__main__":
    sys.exit(main())
