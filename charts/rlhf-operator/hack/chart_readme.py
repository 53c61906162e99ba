"""Generates the chart's README.md: its description, install commands and a table of every
value (key, type, default, the `# --` comment above it in values.yaml), as helm-docs
would (`make chart-readme`; a test fails when it is stale).

    python charts/rlhf-operator/hack/chart_readme.py            # print
    python charts/rlhf-operator/hack/chart_readme.py --write    # write README.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from values_schema import CHART, FREE_FORM, comments  # noqa: E402

INTRO = """\
The Kubernetes operator of [rlhf-operator](https://github.com/rlhf-operator/rlhf-operator):
RL post-training of language models as one custom resource, `RLHFJob` (trainer pods through
a Kubeflow PyTorchJob or a JobSet, vLLM rollout servers in a StatefulSet, restarted together,
resumed from checkpoints, followed in `kubectl get rlhfjobs`, Prometheus and Grafana).

Needs Kubernetes >= 1.30 (ValidatingAdmissionPolicy) and the Kubeflow training-operator (v1, PyTorchJob) or JobSet on
GPU nodes. The RLHFJob CRD is part of the release (`crds.install`): `helm upgrade` updates
it and `helm uninstall` keeps it, with every job (`crds.keep`).

```bash
helm install rlhf ./charts/rlhf-operator -n rlhf-system --create-namespace
kubectl apply -f rlhfjob.yaml        # see examples/rlhfjob.yaml in the repository
kubectl get rlj
```

`values.schema.json` refuses unknown keys, so a misspelt value fails the install.

## The operator's rights in production

Set `watchNamespaces` to the namespaces that run jobs. The operator's rights (RLHFJobs,
their status, their children, pod patch and delete, Events) are then a Role and RoleBinding
in each of those namespaces; cluster-wide it keeps only kopf's read-only discovery
(namespaces, CRDs) and the nodes' Ready condition. Without `watchNamespaces` the same rights
hold in every namespace (a ClusterRoleBinding): fine for a cluster that belongs to one team.

Either way `admissionPolicy.enabled` (on by default) installs two ValidatingAdmissionPolicies
for the operator's ServiceAccount: of a pod it may only add a job's labels (how it adopts a
TrainJob's pods), never change its spec, annotations or owners, and delete only pods of a
job (`rlhf.dev/job`); ConfigMaps, Services, ServiceAccounts, Roles, RoleBindings,
NetworkPolicies and workloads it may change or delete only when an RLHFJob controls them.
The operator itself never writes an object of a child's name that the job does not own (the
job shows a `ChildConflict` condition instead). `security.allowHostPath` (off) is the one
switch that lets jobs mount host paths; with it off the job pods pass the `restricted` Pod
Security level's volume rules.
"""


def _type(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}[type(value)]


def rows(value: Any, path: str, docs: dict[str, str]) -> list[tuple[str, str, str, str]]:
    out = []
    if path:
        leaf = not isinstance(value, dict) or not value or path in FREE_FORM
        if leaf:
            default = json.dumps(value) if value not in ("", None) else '""'
            out.append((path, _type(value), default, docs.get(path, "")))
    if isinstance(value, dict) and value and path not in FREE_FORM:
        for k, v in value.items():
            out += rows(v, f"{path}.{k}" if path else k, docs)
    return out


def generate() -> str:
    text = (CHART / "values.yaml").read_text()
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    lines = [f"# {chart['name']}", "", f"![Version: {chart['version']}](https://img.shields.io/badge/Version-"
             f"{chart['version']}-informational) ![AppVersion: {chart['appVersion']}](https://img.shields.io/badge/"
             f"AppVersion-{chart['appVersion']}-informational)", "", chart.get("description", ""), "", INTRO,
             "## Values", "", "Generated from `values.yaml` by `hack/chart_readme.py`: do not edit.", "",
             "| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for key, kind, default, doc in rows(yaml.safe_load(text), "", comments(text)):
        cell = default.replace("|", "\\|")
        lines.append(f"| `{key}` | {kind} | `{cell}` | {doc.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = generate()
    if "--write" in sys.argv:
        (CHART / "README.md").write_text(out)
    else:
        sys.stdout.write(out)
