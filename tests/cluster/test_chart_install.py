"""`helm install` of charts/rlhf-operator into the real control plane, then the operator
running with exactly the chart's ServiceAccount permissions (its token, not the admin's)
takes a job to Running: the chart's RBAC is enough, and `kubectl auth can-i` shows it is
no more than it says; people bound to `edit` may run jobs; `helm upgrade` updates the CRD
and `helm uninstall` keeps it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_contract import images
from rlhf_launcher.cli import build_parser
from rlhf_launcher.support_cli import cluster_report

from .harness import Cluster, wait_for
from .test_operator import create, job_doc, new_namespace, wait_job

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "rlhf-operator"


def sa_kubeconfig(cluster: Cluster, ns: str, sa: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "c", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": sa, "namespace": ns}}],
    }))
    return path


def test_helm_install_then_the_operator_with_the_chart_permissions_runs_a_job(cluster: Cluster, tmp_path):
    release_ns = f"rlhf-system-{uuid.uuid4().hex[:6]}"
    jobs_ns = new_namespace(cluster, "chart")
    release = f"r{uuid.uuid4().hex[:6]}"
    try:
        # --take-ownership: other tests of this cluster applied the CRD without Helm (as an
        # administrator would have before this chart managed it)
        out = cluster.helm("install", release, str(CHART), "--namespace", release_ns, "--create-namespace",
                           "--set", f"watchNamespaces={{{jobs_ns}}}", "--wait=false", "--take-ownership")
        assert out.returncode == 0, out.stderr
        crd = cluster.get("crd", "rlhfjobs.rlhf.dev")
        assert crd["spec"]["names"]["shortNames"] == ["rlj"]
        # `rlhfctl env` reports the operator the chart installed: its Deployment's version label and image
        env = build_parser().parse_args(["env", "--kubeconfig", str(cluster.kubeconfig)])
        found = [d for d in cluster_report(env)["operator"] if d["namespace"] == release_ns]
        assert found == [{"namespace": release_ns, "name": f"{release}-rlhf-operator", "version": images.VERSION,
                          "image": images.OPERATOR_IMAGE}]
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release  # the release's now

        # `helm upgrade` installs a changed CRD (a new release's schema), and the next upgrade changes it back
        changed = tmp_path / "chart"
        shutil.copytree(CHART, changed)
        crd_file = changed / "files" / "rlhfjobs.crd.yaml"
        new = yaml.safe_load(crd_file.read_text())
        temperature = new["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
            "rollout"]["properties"]["temperature"]
        original = temperature["description"]
        temperature["description"] = original + " (changed by an upgrade)"
        crd_file.write_text(yaml.safe_dump(new, sort_keys=False))
        for chart, expected in ((changed, temperature["description"]), (CHART, original)):
            out = cluster.helm("upgrade", release, str(chart), "--namespace", release_ns,
                               "--set", f"watchNamespaces={{{jobs_ns}}}", "--wait=false")
            assert out.returncode == 0, out.stderr
            live = cluster.get("crd", "rlhfjobs.rlhf.dev")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
            assert live["properties"]["spec"]["properties"]["rollout"]["properties"]["temperature"]["description"] \
                == expected
        sa = f"{release}-rlhf-operator"
        who = f"--as=system:serviceaccount:{release_ns}:{sa}"

        def can(*args: str) -> str:
            return cluster.kubectl("auth", "can-i", *args, who, check=False).stdout.strip()
        assert can("patch", "rlhfjobs.rlhf.dev", "-n", jobs_ns, "--subresource=status") == "yes"
        assert can("create", "pytorchjobs.kubeflow.org", "-n", jobs_ns) == "yes"
        assert can("create", "statefulsets.apps", "-n", "default") == "no"  # only the watched namespace
        assert can("get", "secrets", "-n", jobs_ns) == "no"
        assert can("delete", "pods", "-n", jobs_ns) == "yes"  # force-delete the pods of a lost node
        assert can("create", "pods", "-n", jobs_ns) == "no"
        assert can("get", "nodes/n1") == "yes" and can("patch", "nodes/n1") == "no"
        assert can("update", f"leases.coordination.k8s.io/{sa}", "-n", release_ns) == "yes"  # the release's own Lease
        assert can("update", "leases.coordination.k8s.io/rlhf-operator", "-n", release_ns) == "no"  # not another's
        assert can("get", "namespaces/default") == "no"  # kopf may list namespace names, not read one

        # people: a user bound to the built-in `edit` role in a namespace may run RLHFJobs there
        # (the chart's ClusterRoles aggregate into edit, by the controller-manager's aggregation
        # controller), one bound to `view` may only read them; neither writes a job's status
        cluster.kubectl("create", "rolebinding", "alice-edit", "--clusterrole=edit", "--user=alice", "-n", jobs_ns)
        cluster.kubectl("create", "rolebinding", "bob-view", "--clusterrole=view", "--user=bob", "-n", jobs_ns)

        def person_can(user: str, *args: str) -> str:
            return cluster.kubectl("auth", "can-i", *args, "-n", jobs_ns, f"--as={user}", check=False).stdout.strip()
        wait_for(lambda: person_can("alice", "create", "rlhfjobs.rlhf.dev") == "yes", 30,
                 "the edit role aggregates RLHFJob permissions")
        assert person_can("alice", "delete", "rlhfjobs.rlhf.dev") == "yes"
        assert person_can("alice", "patch", "rlhfjobs.rlhf.dev", "--subresource=status") == "no"
        wait_for(lambda: person_can("bob", "list", "rlhfjobs.rlhf.dev") == "yes", 30, "the view role reads RLHFJobs")
        assert person_can("bob", "create", "rlhfjobs.rlhf.dev") == "no"
        alice = cluster.kubectl("create", "-n", jobs_ns, "-f", "-", "--as=alice", "--dry-run=server",
                                input=yaml.safe_dump(job_doc("alices")), check=False)
        assert alice.returncode == 0, alice.stderr  # the API server admits alice's job

        config = sa_kubeconfig(cluster, release_ns, sa, tmp_path / "operator.kubeconfig")
        log = tmp_path / "operator.log"
        # The chart's Deployment runs `rlhfctl operator --lease-namespace=<release ns>
        # --lease-name=<release's full name> --namespace=<watched>`; the same here, as a local
        # process with the chart SA's token.
        with open(log, "ab") as fh:
            p = subprocess.Popen(
                [sys.executable, "-m", "rlhf_launcher.cli", "operator", "--namespace", jobs_ns,
                 "--lease-namespace", release_ns, "--lease-name", sa, "--lease-duration", "4", "--resync-seconds", "2",
                 "--metrics-port", "0"],
                stdout=fh, stderr=subprocess.STDOUT, env={**cluster.env, "KUBECONFIG": str(config)})
        try:
            create(cluster, jobs_ns, job_doc("viachart"))
            j = wait_job(cluster, jobs_ns, "viachart", "Running", timeout=120, log=log)
            assert j["status"]["restarts"] == 0
            assert "Forbidden" not in log.read_text() and "forbidden" not in log.read_text()
        finally:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        out = cluster.helm("uninstall", release, "--namespace", release_ns)
        assert out.returncode == 0, out.stderr
        assert cluster.get("crd", "rlhfjobs.rlhf.dev")  # the CRD is kept on uninstall
    finally:
        cluster.kubectl("delete", "namespace", jobs_ns, release_ns, "--wait=false", check=False)
