"""The chart's generated files are fresh, every value is documented, and every metric the
alerts and dashboards query is one the trainer or the operator declares (no helm needed)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from rlhf_contract.api.crd import crd_yaml

from .conftest import CHART, REPO


def _schema_module():
    spec = importlib.util.spec_from_file_location("values_schema", CHART / "hack" / "values_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_chart_crd_is_the_generated_one():
    assert (CHART / "files" / "rlhfjobs.crd.yaml").read_text() == crd_yaml() == (REPO / "crds" / "rlhfjobs.yaml").read_text(), \
        "the chart's CRD is stale: run `make chart-crd` (rlhfctl crd, copied into charts/rlhf-operator/files/)"
    assert not (CHART / "crds").exists()  # Helm would install it once and never upgrade it (templates/crd.yaml does)


def test_chart_readme_is_fresh_and_lists_every_value():
    spec = importlib.util.spec_from_file_location("chart_readme", CHART / "hack" / "chart_readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme = (CHART / "README.md").read_text()
    assert readme == mod.generate(), "the chart's README.md is stale: run `make chart-readme`"
    for key in ("crds.keep", "image.digest", "extraEnv", "rbac.aggregateToDefaultRoles", "podDisruptionBudget.enabled",
                "prometheusRule.thresholds.klMax"):
        assert f"| `{key}` |" in readme, key


def test_values_schema_is_fresh_and_closed():
    assert (CHART / "values.schema.json").read_text() == _schema_module().generate(), \
        "values.schema.json is stale: run `make chart-schema`"
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False  # a misspelt top-level value fails the install
    assert schema["properties"]["image"]["properties"]["tag"]["description"].startswith("Image tag")
    assert "additionalProperties" not in schema["properties"]["podAnnotations"]  # free-form map


def test_every_value_has_a_doc_comment(tmp_path):
    mod = _schema_module()
    docs = mod.comments((CHART / "values.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def paths(node, prefix=""):
        for k, v in node.items():
            yield prefix + k
            if isinstance(v, dict):
                yield from paths(v, prefix + k + ".")
    missing = [p for p in paths(values) if p not in docs]
    assert not missing, f"values.yaml keys without a `# --` comment: {missing}"
    # The generator refuses an undocumented key, naming it.
    bad = tmp_path / "values.yaml"
    bad.write_text("# -- ok\na: 1\nb: 2\n")
    mod.CHART = tmp_path
    try:
        mod.generate()
    except SystemExit as err:
        assert "no `# --` comment above: b" in str(err)
    else:
        raise AssertionError("an undocumented value was accepted")


_METRIC = re.compile(r"\b(rlhf_[a-z0-9_]+)\b")
_NOT_METRICS = {"rlhf_job"}  # a label


def _queried_names() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                used.setdefault(path.name, set()).update(_METRIC.findall(t["expr"]))
    rules = (CHART / "templates" / "prometheusrule.yaml").read_text()
    exprs = re.findall(r"^\s*expr: (.*)$", rules, re.M)
    used["prometheusrule.yaml"] = {n for e in exprs for n in _METRIC.findall(e)}
    return {k: v - _NOT_METRICS for k, v in used.items()}


def _declared(module: str, function: str) -> set[str]:
    """Names a role package declares, read in its own interpreter (one role per test process)."""
    code = f"import json, {module} as m; print(json.dumps(sorted(m.{function}())))"
    return set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                         text=True).stdout))


def test_every_queried_metric_is_declared():
    declared = _declared("rlhf_trainer.metrics", "exported_names") | _declared("rlhf_operator.metrics", "exported_names")
    assert "rlhf_last_step_timestamp_seconds" in declared and "rlhf_operator_reconciles_total" in declared
    used = _queried_names()
    assert used["training-run.json"] and used["operator.json"] and used["prometheusrule.yaml"]
    for where, names in used.items():
        assert names <= declared, f"{where} queries undeclared metrics {sorted(names - declared)}"


_VLLM_METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+)\b")


def test_every_queried_vllm_metric_is_one_vllm_exports():
    """The vLLM panels' names against what the pinned vLLM release's own source declares
    (tests/protocol/vllm_facts.json, from its v1/metrics/*.py): a counter is exported with
    `_total`, a histogram as `_bucket`, `_sum` and `_count`."""
    facts = json.loads((Path(__file__).resolve().parents[1] / "protocol" / "vllm_facts.json").read_text())
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    exported = {name + end for name, kind in facts["prometheus_metrics"].items() for end in suffixes[kind]}
    assert {"vllm:num_requests_running", "vllm:generation_tokens_total"} <= exported
    used = set()
    for path in sorted((CHART / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                used |= set(_VLLM_METRIC.findall(t["expr"]))
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"} <= used  # the dashboard has its vLLM panels
    assert used <= exported, f"not exported by vLLM {facts['vllm_version']}: {sorted(used - exported)}"
