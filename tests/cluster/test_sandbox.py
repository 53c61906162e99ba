"""The operator creates the code sandbox of a job with `reward.type: code` on the real control
plane, in a namespace that enforces the `restricted` Pod Security level: the StatefulSet
controller's pod creation is admitted (so the pod spec passes `restricted`), the pod has no
service-account token, and the NetworkPolicy has no egress."""

from __future__ import annotations

import pytest

from .harness import Cluster, wait_for
from .test_admission import install_crd
from .test_operator import create, job_doc, new_namespace, operator

pytestmark = pytest.mark.cluster


def test_code_reward_job_gets_a_restricted_sandbox_without_token_or_egress(cluster: Cluster, tmp_path):
    install_crd(cluster)
    ns = new_namespace(cluster, "sbx")  # enforces `restricted`
    try:
        with operator(cluster, ns, tmp_path / "operator.log"):
            create(cluster, ns, job_doc("coder", reward={"type": "code"}))

            def sandbox_pods():
                items = cluster.get("pods", namespace=ns, selector="rlhf.dev/sandbox-of=coder")["items"]
                return items or None

            try:
                (pod,) = wait_for(sandbox_pods, 90, "the sandbox pod created (admitted as restricted)")
            except TimeoutError:
                events = [e.get("message", "") for e in cluster.get("events", namespace=ns)["items"]
                          if e["involvedObject"].get("name") == "coder-sandbox"]
                log = (tmp_path / "operator.log").read_text()[-3000:]
                raise AssertionError(f"no sandbox pod; events: {events}\n{log}") from None
            spec = pod["spec"]
            assert spec["automountServiceAccountToken"] is False
            assert not any("serviceaccount" in m["mountPath"] for c in spec["containers"]
                           for m in c.get("volumeMounts", []))
            assert "rlhf.dev/job" not in pod["metadata"]["labels"]
            policy = cluster.get("networkpolicy", "coder-sandbox", namespace=ns)["spec"]
            assert "Egress" in policy["policyTypes"] and not policy.get("egress")
            service = cluster.get("service", "coder-sandbox", namespace=ns)
            assert service["spec"]["ports"][0]["port"] == 8080
            sts = cluster.get("statefulset", "coder-sandbox", namespace=ns)
            assert sts["metadata"]["ownerReferences"][0]["kind"] == "RLHFJob"
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
