"""Generates values.schema.json from values.yaml (`make chart-schema`; a test checks it is fresh).

Each key's type comes from its default; its description from the `# --` comment above it
(which every key must have: the generator fails naming the key otherwise). Objects with
keys are closed (`additionalProperties: false`, so a misspelt value fails `helm install`);
an empty object `{}` and the keys in FREE_FORM take any keys (labels, annotations,
Kubernetes objects). Arrays of strings are typed; other arrays take any items.

    python charts/rlhf-operator/hack/values_schema.py            # print
    python charts/rlhf-operator/hack/values_schema.py --write    # write values.schema.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1]
# Kubernetes objects or maps whose keys the user chooses, although the default has some.
FREE_FORM = {
    "resources", "resources.requests", "resources.limits", "podSecurityContext", "securityContext",
    "grafana.dashboards.labels", "trainerMetrics.networkPolicy.prometheusPodLabels", "global",
}
_KEY = re.compile(r"^(\s*)([A-Za-z0-9_./\-]+|\"[^\"]+\"):")


def comments(text: str) -> dict[str, str]:
    """{dotted key: its `# --` comment}, from the indentation of values.yaml."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: str | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            pending = stripped[4:].strip()
            continue
        if not stripped or stripped.startswith("#") or stripped.startswith("- "):
            continue
        m = _KEY.match(line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2).strip('"')
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        if pending is not None:
            out[path] = pending
        pending = None
    return out


def schema_of(value: Any, path: str, docs: dict[str, str], missing: list[str]) -> dict[str, Any]:
    node: dict[str, Any] = {}
    if path:
        if path in docs:
            node["description"] = docs[path]
        else:
            missing.append(path)
    if isinstance(value, bool):
        node["type"] = "boolean"
    elif isinstance(value, int):
        node["type"] = "integer"
    elif isinstance(value, float):
        node["type"] = "number"
    elif isinstance(value, str):
        node["type"] = "string"
    elif isinstance(value, list):
        node["type"] = "array"
        if value and all(isinstance(v, str) for v in value) or path in ("imagePullSecrets", "watchNamespaces"):
            node["items"] = {"type": "string"}
    elif isinstance(value, dict):
        node["type"] = "object"
        if value and path not in FREE_FORM:
            node["additionalProperties"] = False
            node["properties"] = {
                k: schema_of(v, f"{path}.{k}" if path else k, docs, missing) for k, v in value.items()}
        else:
            for k, v in value.items():  # document the defaults' keys, but allow others
                schema_of(v, f"{path}.{k}", docs, missing)
    return node


def generate() -> str:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    missing: list[str] = []
    root = schema_of(values, "", comments(text), missing)
    if missing:
        raise SystemExit(f"values.yaml: no `# --` comment above: {', '.join(missing)}")
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "rlhf-operator chart values", **root}
    return json.dumps(schema, indent=2) + "\n"


if __name__ == "__main__":
    out = generate()
    if "--write" in sys.argv:
        (CHART / "values.schema.json").write_text(out)
    else:
        sys.stdout.write(out)
