"""The chart's monitors against the pods the operator really makes, on the real API server:
one job per backend (PyTorchJob and JobSet, two trainer nodes each), the chart rendered with
its PodMonitors and NetworkPolicy, and each one's label selector asked of the API server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .harness import Cluster, wait_for
from .test_operator import create, job_doc, operator_in_namespace, pods, wait_job

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "rlhf-operator"


def selector_of(label_selector: dict) -> str:
    """A Kubernetes LabelSelector as kubectl's -l string."""
    parts = [f"{k}={v}" for k, v in label_selector.get("matchLabels", {}).items()]
    for e in label_selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        parts.append(f"{e['key']} in ({','.join(e['values'])})")
    return ",".join(parts)


def test_monitors_and_network_policy_select_the_pods_of_both_backends(cluster: Cluster, tmp_path_factory):
    # the baseline namespace: a two-node PyTorchJob's worker init container (the
    # training-operator's) is refused at the restricted level (see docs/cluster.md, Restricted namespaces)
    with operator_in_namespace(cluster, tmp_path_factory, "mon", multi=True) as setup:
        ns, log = setup["multi"], setup["log"]
        create(cluster, ns, job_doc("mon-ptj", nodes=2))
        create(cluster, ns, job_doc("mon-js", nodes=2, backend="JobSet"))
        for name in ("mon-ptj", "mon-js"):
            wait_job(cluster, ns, name, "Running", 0, log=log)
            wait_for(lambda: len([p for p in pods(cluster, ns, name) if p["status"].get("phase") == "Running"]) == 4,
                     90, f"{name}: 2 trainer and 2 rollout pods Running")
        rendered = cluster.helm("template", "rel", str(CHART), "--namespace", "rlhf-system", "--kube-version", "1.34.0",
                                "--set", "trainerMetrics.podMonitor.enabled=true",
                                "--set", "trainerMetrics.rolloutPodMonitor.enabled=true",
                                "--set", "trainerMetrics.networkPolicy.enabled=true",
                                "--set", f"watchNamespaces={{{ns}}}").stdout
        docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}
        by_role = {}
        for p in pods(cluster, ns, "mon-ptj") + pods(cluster, ns, "mon-js"):
            by_role.setdefault(p["metadata"]["labels"]["rlhf.dev/role"], set()).add(p["metadata"]["name"])

        def selected(label_selector: dict) -> set[str]:
            found = cluster.get("pods", namespace=ns, selector=selector_of(label_selector))["items"]
            return {p["metadata"]["name"] for p in found}

        trainers = selected(docs[("PodMonitor", "rel-rlhf-operator-trainers")]["spec"]["selector"])
        assert trainers == by_role["trainer"] and len(trainers) == 4  # every trainer pod, both backends
        rank0 = {"mon-ptj-trainer-master-0"} | {
            p["metadata"]["name"] for p in pods(cluster, ns, "mon-js")
            if p["metadata"]["labels"]["rlhf.dev/role"] == "trainer"
            and p["metadata"]["labels"].get("batch.kubernetes.io/job-completion-index") == "0"}
        assert len(rank0) == 2 and rank0 <= trainers  # the pods whose rank 0 serves the step metrics
        servers = selected(docs[("PodMonitor", "rel-rlhf-operator-rollout-servers")]["spec"]["selector"])
        assert servers == by_role["rollout"] and len(servers) == 4
        policy = docs[("NetworkPolicy", "rel-rlhf-operator-trainer-metrics")]
        assert policy["metadata"]["namespace"] == ns
        assert selected(policy["spec"]["podSelector"]) == trainers | servers
        # `rlhfctl render` prints what the operator created: every rendered field is in the live object
        for name, doc in (("mon-ptj", job_doc("mon-ptj", nodes=2)), ("mon-js", job_doc("mon-js", nodes=2, backend="JobSet"))):
            path = tmp_path_factory.mktemp("render") / f"{name}.yaml"
            path.write_text(yaml.safe_dump(doc))
            uid = cluster.get("rlhfjob", name, namespace=ns)["metadata"]["uid"]
            out = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "render", str(path), "--namespace", ns,
                                  "--uid", uid], capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            rendered_children = [d for d in yaml.safe_load_all(out.stdout) if d]
            kinds = {d["kind"] for d in rendered_children}
            assert {"ConfigMap", "ServiceAccount", "NetworkPolicy"} <= kinds
            assert ("JobSet" in kinds) == (name == "mon-js") and ("PyTorchJob" in kinds) == (name == "mon-ptj")
            for child in rendered_children:
                live = cluster.get(f"{child['kind'].lower()}.{child['apiVersion'].split('/')[0]}"
                                   if "/" in child["apiVersion"] else child["kind"].lower(),
                                   child["metadata"]["name"], namespace=ns)
                assert within(child, live), f"{name}: rendered {child['kind']} {child['metadata']['name']} differs"
        for name in ("mon-ptj", "mon-js"):
            cluster.kubectl("delete", "rlhfjob", name, "-n", ns, "--wait=false")


def within(rendered, live) -> bool:
    """Every field of `rendered` has the same value in `live` (which also has the API server's defaults)."""
    if isinstance(rendered, dict):
        return isinstance(live, dict) and all(k in live and within(v, live[k]) for k, v in rendered.items())
    if isinstance(rendered, list):
        return isinstance(live, list) and len(rendered) == len(live) and all(map(within, rendered, live))
    return rendered == live or str(rendered) == str(live)
