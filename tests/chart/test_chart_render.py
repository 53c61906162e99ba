"""The chart rendered by the real `helm`: lint, what each value turns on, the schema
refusing typos, least-privilege RBAC, Kubernetes objects that round-trip through the
Kubernetes models, and the PrometheusRule checked by the real `promtool` (check rules,
and one `test rules` case per alert: charts/rlhf-operator/tests/promtool/alerts.yaml)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess

import pytest
import yaml

from rlhf_contract.api.crd import crd_yaml
from kubernetes.client import ApiClient

from .conftest import CHART, by_kind

MODELS = {"Deployment": "V1Deployment", "ServiceAccount": "V1ServiceAccount", "ClusterRole": "V1ClusterRole",
          "ClusterRoleBinding": "V1ClusterRoleBinding", "Role": "V1Role", "RoleBinding": "V1RoleBinding",
          "Service": "V1Service", "ConfigMap": "V1ConfigMap", "NetworkPolicy": "V1NetworkPolicy", "Pod": "V1Pod",
          "ValidatingAdmissionPolicy": "V1ValidatingAdmissionPolicy",
          "ValidatingAdmissionPolicyBinding": "V1ValidatingAdmissionPolicyBinding"}
ALL_ON = ["metrics.serviceMonitor.enabled=true", "trainerMetrics.podMonitor.enabled=true",
          "trainerMetrics.rolloutPodMonitor.enabled=true",
          "prometheusRule.enabled=true", "grafana.dashboards.enabled=true"]


def test_lint_strict(helm_bin):
    out = subprocess.run([str(helm_bin), "lint", "--strict", str(CHART), *[a for s in ALL_ON for a in ("--set", s)]],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_defaults_render_the_operator_and_nothing_of_monitoring(render):
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    # the operator's two ClusterRoles, and two aggregated into view / edit / admin for people
    # and `helm test`'s Pod with its own ServiceAccount, Role and RoleBinding; the admission
    # policies that hold the operator to its own children and to adoption on pods, and jobs to the queue-label rule
    assert kinds == ["ClusterRole"] * 4 + ["ClusterRoleBinding", "ClusterRoleBinding", "CustomResourceDefinition",
                                           "Deployment", "Pod", "Role", "Role", "RoleBinding", "RoleBinding",
                                           "Service", "ServiceAccount", "ServiceAccount"] + [
        "ValidatingAdmissionPolicy"] * 3 + ["ValidatingAdmissionPolicyBinding"] * 3
    (crd,) = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert crd["spec"] == yaml.safe_load(crd_yaml())["spec"]  # the generated CRD, numbers intact
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}  # uninstall keeps every job
    dep = by_kind(docs)[("Deployment", "rel-rlhf-operator")]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/rlhf-operator/operator:0.1.0"  # appVersion when image.tag is empty
    assert c["args"] == ["--metrics-port=8080", "--lease-namespace=rlhf-system", "--lease-name=rel-rlhf-operator",
                         "--lease-duration=15",
                         "--resync-seconds=15", "--log-format=text", "--health-port=8081"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert pod["serviceAccountName"] == "rel-rlhf-operator"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_every_object_round_trips_through_the_kubernetes_models(render):
    api = ApiClient()
    docs = render(*ALL_ON, "watchNamespaces={ml}", "trainerMetrics.networkPolicy.enabled=true")
    checked = 0
    for d in docs:
        if d["kind"] in MODELS:
            model = api._ApiClient__deserialize(copy.deepcopy(d), MODELS[d["kind"]])
            assert api.sanitize_for_serialization(model) == d, f"{d['kind']} {d['metadata']['name']}: unknown field"
            checked += 1
    assert checked >= 10


def test_every_object_validates_against_the_kubernetes_schema(render):
    """Strict OpenAPI schemas of Kubernetes 1.34 (kubernetes-validate): types, required
    fields, no unknown fields. The monitoring.coreos.com kinds are checked by helm-unittest
    and the tests above, not against their CRD schemas (none is packaged on PyPI here)."""
    import kubernetes_validate

    docs = render(*ALL_ON, "watchNamespaces={ml}", "trainerMetrics.networkPolicy.enabled=true")
    core = [d for d in docs if d["apiVersion"].split("/")[0] != "monitoring.coreos.com"]
    assert len(core) >= 12
    for d in core:
        kubernetes_validate.validate(d, "1.34", strict=True)
    bad = copy.deepcopy(next(d for d in core if d["kind"] == "Deployment"))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.34", strict=True)


def test_rbac_is_least_privilege(render):
    docs = by_kind(render())
    rules = docs[("ClusterRole", "rel-rlhf-operator")]["rules"]
    verbs = {(g, r): set(rule["verbs"]) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    # deleted when their node is lost; patched only to label a TrainJob's pods as the job's
    assert verbs[("", "pods")] == {"get", "list", "watch", "patch", "delete"}
    assert verbs[("rlhf.dev", "rlhfjobs/status")] == {"get", "patch"}
    # rollout.nodesPerServer > 1: the rollout servers' LeaderWorkerSet, written like the StatefulSet
    assert verbs[("leaderworkerset.x-k8s.io", "leaderworkersets")] == verbs[("apps", "statefulsets")]
    from rlhf_operator.kube import CHILD_KINDS  # each kind's watch fills the index that reconciles read
    for ck in CHILD_KINDS:
        assert {"list", "watch"} <= verbs[(ck.group, ck.plural)], ck.plural
    assert ("", "secrets") not in verbs and all("*" not in v for v in verbs.values())
    assert not any(r in ("clusterroles", "clusterrolebindings") for _, r in verbs)
    discovery = docs[("ClusterRole", "rel-rlhf-operator-discovery")]["rules"]  # what kopf observes
    assert {r: tuple(rule["verbs"]) for rule in discovery for r in rule["resources"]} == {
        "namespaces": ("list", "watch"), "customresourcedefinitions": ("list", "watch"),
        "nodes": ("get", "list", "watch")}  # is a pod's node still Ready (lost nodes): the node index
    lease = docs[("Role", "rel-rlhf-operator-leader-election")]["rules"]
    assert {"resourceNames": ["rel-rlhf-operator"], "verbs": ["get", "update"]}.items() <= lease[1].items()
    test = docs[("Role", "rel-rlhf-operator-test")]["rules"]  # helm test: one job's life, reading its children
    assert {v for rule in test for v in rule["verbs"]} == {"create", "get", "delete"}
    assert all(r == "rlhfjobs" for rule in test if set(rule["verbs"]) != {"get"} for r in rule["resources"])


def test_watch_namespaces_bind_the_role_in_those_namespaces_only(render):
    """The production setting: the operator's rights are a Role in each watched namespace,
    the same rules as the cluster-wide ClusterRole otherwise; cluster-wide only discovery."""
    docs = render("watchNamespaces={ml,research}")
    bindings = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
                and d["roleRef"]["name"] == "rel-rlhf-operator"]
    assert sorted((d["kind"], d["metadata"]["namespace"], d["roleRef"]["kind"]) for d in bindings) == [
        ("RoleBinding", "ml", "Role"), ("RoleBinding", "research", "Role")]
    roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rel-rlhf-operator"]
    cluster_wide = by_kind(render())[("ClusterRole", "rel-rlhf-operator")]["rules"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert all(r["rules"] == cluster_wide for r in roles)
    assert [d["metadata"]["name"] for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")
            and "rel-rlhf-operator" in (d["metadata"]["name"], d.get("roleRef", {}).get("name"))] == []
    args = by_kind(docs)[("Deployment", "rel-rlhf-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=ml" in args and "--namespace=research" in args


def test_monitoring_objects_when_enabled(render):
    docs = by_kind(render(*ALL_ON, "metrics.serviceMonitor.additionalLabels.release=kps",
                          "grafana.dashboards.annotations.grafana_folder=RLHF"))
    sm = docs[("ServiceMonitor", "rel-rlhf-operator")]
    assert sm["metadata"]["labels"]["release"] == "kps" and sm["spec"]["endpoints"][0]["port"] == "metrics"
    pm = docs[("PodMonitor", "rel-rlhf-operator-trainers")]["spec"]
    assert pm["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "rlhf-operator",
                                             "rlhf.dev/role": "trainer"}  # both backends' trainer pods
    servers = docs[("PodMonitor", "rel-rlhf-operator-rollout-servers")]["spec"]
    assert servers["selector"]["matchLabels"]["rlhf.dev/role"] == "rollout"
    assert servers["podMetricsEndpoints"][0]["port"] == "http"
    assert pm["podMetricsEndpoints"][0]["port"] == "metrics" and pm["namespaceSelector"] == {"any": True}
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_rlhf_dev_job"], "targetLabel": "rlhf_job"} in \
        pm["podMetricsEndpoints"][0]["relabelings"]
    rule = docs[("PrometheusRule", "rel-rlhf-operator")]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"RLHFJobFailed", "RLHFJobRestarting", "RLHFJobStalled", "RLHFWeightSyncSlow",
                      "RLHFRewardCollapsed", "RLHFKLDiverging", "RLHFJudgeAnswersUnparsable",
                      "RLHFOperatorReconcileErrors", "RLHFOperatorNoLeader"}
    for name in ("training-run", "operator"):
        cm = docs[("ConfigMap", f"rel-rlhf-operator-dashboard-{name}")]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "RLHF"}
        assert json.loads(cm["data"][f"{name}.json"]) == json.loads((CHART / "dashboards" / f"{name}.json").read_text())


def test_thresholds_reach_the_rules(render, tmp_path):
    # A fraction is allowed by the schema (from a values file: `--set` passes "0.5" as a string).
    docs = by_kind(render(values={"prometheusRule": {"enabled": True, "thresholds": {"noStepMinutes": 30, "klMax": 0.5}}},
                          tmp=tmp_path))
    rules = {r["alert"]: r for g in docs[("PrometheusRule", "rel-rlhf-operator")]["spec"]["groups"] for r in g["rules"]}
    assert rules["RLHFJobStalled"]["expr"] == "time() - rlhf_last_step_timestamp_seconds > 1800"
    assert rules["RLHFKLDiverging"]["expr"] == "rlhf_kl > 0.5"


@pytest.mark.parametrize("sets, message", [
    (["replicaCuont=2"], "additional properties 'replicaCuont' not allowed"),
    (["metrics.serviceMonitor.enabeld=true"], "additional properties 'enabeld' not allowed"),
    (["replicaCount=two"], "replicaCount"),
    (["metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"], "are both true"),
    (["trainerMetrics.networkPolicy.enabled=true"], "needs watchNamespaces"),
    (["serviceAccount.create=false"], "serviceAccount.name is required"),
])
def test_bad_values_fail_with_the_value_named(render, sets, message):
    out = render(*sets, check=False)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_prometheus_rule_passes_promtool(render, promtool, tmp_path):
    docs = by_kind(render("prometheusRule.enabled=true"))
    groups = docs[("PrometheusRule", "rel-rlhf-operator")]["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    check = subprocess.run([str(promtool), "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 9 rules found" in check.stdout, check.stdout + check.stderr
    cases = yaml.safe_load((CHART / "tests" / "promtool" / "alerts.yaml").read_text())
    tested = {t["alertname"] for c in cases["tests"] for t in c["alert_rule_test"] if t.get("exp_alerts")}
    assert tested == {r["alert"] for g in groups for r in g["rules"]}, "every alert needs a firing test case"
    shutil.copy(CHART / "tests" / "promtool" / "alerts.yaml", tmp_path / "alerts_test.yaml")
    test = subprocess.run([str(promtool), "test", "rules", str(tmp_path / "alerts_test.yaml")], capture_output=True,
                          text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_metrics_disabled_serves_nothing_and_renders_no_service(render):
    docs = render("metrics.enabled=false")
    assert not [d for d in docs if d["kind"] == "Service"]
    (c,) = by_kind(docs)[("Deployment", "rel-rlhf-operator")]["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=0" in c["args"] and [p["name"] for p in c["ports"]] == ["health"]
    out = render("metrics.enabled=false", "metrics.serviceMonitor.enabled=true", check=False)
    assert out.returncode != 0 and "needs metrics.enabled" in out.stderr


def test_every_alert_links_to_its_runbook_in_the_docs(render):
    runbooks = (CHART.parents[1] / "docs" / "alerts.md").read_text()
    docs = render("prometheusRule.enabled=true")
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == 9
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        assert url == f"https://github.com/rlhf-operator/rlhf-operator/blob/main/docs/alerts.md#{alert['alert'].lower()}"
        assert f"\n### {alert['alert']}\n" in runbooks, f"docs/alerts.md has no runbook for {alert['alert']}"
        assert alert.get("for"), f"{alert['alert']} fires on a single evaluation"


def test_installs_as_a_subchart_with_global_values_and_its_enabled_condition(helm_bin, tmp_path):
    """A parent chart (helm#10392: a schema that refuses `global` breaks every parent that
    sets one) with `condition: rlhf-operator.enabled`."""
    parent = tmp_path / "platform"
    shutil.copytree(CHART, parent / "charts" / "rlhf-operator", ignore=shutil.ignore_patterns("tests", "hack"))
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "rlhf-operator", "version": "0.1.0", "condition": "rlhf-operator.enabled"}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example"},
                                                        "rlhf-operator": {"enabled": True}}))

    def kinds(*sets):
        out = subprocess.run([str(helm_bin), "template", "p", str(parent), "--kube-version", "1.34.0",
                              *[a for x in sets for a in ("--set", x)]], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return [d["kind"] for d in yaml.safe_load_all(out.stdout) if d]

    assert "Deployment" in kinds() and "CustomResourceDefinition" in kinds()
    assert kinds("rlhf-operator.enabled=false") == []


def test_admission_policies_hold_the_operators_service_account_and_can_be_turned_off(render):
    """The policies match the release's ServiceAccount only (`serviceAccount.name` too), deny,
    fail closed; their CEL is checked by the real API server in
    tests/cluster/test_ownership.py."""
    docs = by_kind(render("serviceAccount.name=ops"))
    pods = docs[("ValidatingAdmissionPolicy", "rel-rlhf-operator-pods")]["spec"]
    children = docs[("ValidatingAdmissionPolicy", "rel-rlhf-operator-children")]["spec"]
    for spec in (pods, children):
        assert spec["matchConditions"] == [{"name": "the-operator", "expression":
                                            "request.userInfo.username == 'system:serviceaccount:rlhf-system:ops'"}]
        assert spec["failurePolicy"] == "Fail" and all(v["reason"] == "Forbidden" for v in spec["validations"])
    # every kind of child the operator writes, besides pods (whose rules are the pod policy's)
    from rlhf_operator.kube import _PLURALS
    written = {p for k, p in _PLURALS.items() if k not in ("Pod", "Event", "RLHFJob", "Lease", "Node")}
    assert set(children["matchConstraints"]["resourceRules"][0]["resources"]) == written
    for name in ("pods", "children"):
        binding = docs[("ValidatingAdmissionPolicyBinding", f"rel-rlhf-operator-{name}")]["spec"]
        assert binding == {"policyName": f"rel-rlhf-operator-{name}", "validationActions": ["Deny"]}
    assert not [d for d in render("admissionPolicy.enabled=false") if "AdmissionPolicy" in d["kind"]]


def test_allow_host_path_sets_the_operators_environment(render):
    def env(*sets):
        dep = by_kind(render(*sets))[("Deployment", "rel-rlhf-operator")]
        return dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RLHF_ALLOW_HOST_PATH", "value": "1"} in env("security.allowHostPath=true")
    assert "RLHF_ALLOW_HOST_PATH" not in {e["name"] for e in env()}


def test_the_jobs_admission_policy_is_the_contracts_queue_label_rule(render):
    """A CRD's CEL cannot read labels: the chart's policy carries QUEUE_LABEL_BACKEND as is."""
    from rlhf_contract.api.rules import QUEUE_LABEL_BACKEND

    docs = by_kind(render())
    policy = docs[("ValidatingAdmissionPolicy", "rel-rlhf-operator-jobs")]["spec"]
    assert policy["matchConstraints"]["resourceRules"][0]["resources"] == ["rlhfjobs"]
    (rule,) = policy["validations"]
    assert rule["expression"] == QUEUE_LABEL_BACKEND.cel
    assert rule["message"] == f"spec.{QUEUE_LABEL_BACKEND.field_path}: {QUEUE_LABEL_BACKEND.message}"
    binding = docs[("ValidatingAdmissionPolicyBinding", "rel-rlhf-operator-jobs")]["spec"]
    assert binding == {"policyName": "rel-rlhf-operator-jobs", "validationActions": ["Deny"]}
