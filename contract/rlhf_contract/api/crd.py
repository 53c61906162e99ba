"""The RLHFJob CustomResourceDefinition, generated from the pydantic models.

`rlhfctl crd` prints it; `crds/rlhfjobs.yaml` is that output (a test fails when stale).
pydantic's JSON schema (`ApiJsonSchema`: every integer an int64 with its bounds) is turned
into a Kubernetes structural schema: references are inlined, `Optional` becomes `nullable`,
exclusive bounds use the OpenAPI v3.0 form, and the cross-field RULES become
`x-kubernetes-validations` (CEL) on `spec`. The API server cannot refuse NaN or infinity
(JSON has no such numbers); the Python models refuse them.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from .common import CRD_SCHEMA, ApiJsonSchema
from .models import (
    API_GROUP, API_VERSION, KIND, MAX_NAME_LENGTH, PLURAL, SHORT_NAME, RLHFJobSpec, RLHFJobStatus, RunPolicy,
)
from .rules import CLUSTER_RULES, IMMUTABLE_FIELDS, MUTABLE_FIELDS, RULES, immutable_cel

_DROP = {"title", "additionalProperties"}
CATEGORY = "rlhf"
"""`kubectl get rlhf` lists every RLHFJob; not `all`, which `kubectl delete all` would include."""


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if CRD_SCHEMA in node:  # a Kubernetes object the CRD describes further (a pod volume's sources)
        return copy.deepcopy(node[CRD_SCHEMA])
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        nullable = len(variants) < len(node["anyOf"])
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(variants) == 1:
            merged = _structural({**variants[0], **rest}, defs)
            if nullable:
                merged["nullable"] = True
            return merged
        raise ValueError(f"cannot express anyOf with several variants in a CRD: {node}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP and not (key == "additionalProperties" and isinstance(value, dict)):
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        elif key == "description":
            out[key] = " ".join(value.split())
        elif key == "default":  # a null field of an object's default is an absent one (an enum refuses null)
            out[key] = _without_nulls(value)
        else:
            out[key] = _structural(value, defs)
    if "properties" in out:
        out.setdefault("type", "object")
    return out


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return [_without_nulls(v) for v in value] if isinstance(value, list) else value


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=ApiJsonSchema)
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def spec_schema() -> dict[str, Any]:
    schema = _schema(RLHFJobSpec)
    schema["x-kubernetes-validations"] = [
        {"rule": r.cel, "message": f"spec.{r.field_path}: {r.message}", "fieldPath": f".{r.field_path}"}
        for r in (*RULES, *CLUSTER_RULES)
    ] + [
        {"rule": immutable_cel(f), "fieldPath": f".{f}",
         "message": f"spec.{f} cannot change once the job exists (only "
         f"{' and '.join('spec.' + m for m in MUTABLE_FIELDS)} can); create a new job "
         "(checkpoints can be copied over)"}
        for f in IMMUTABLE_FIELDS
    ] + [{"rule": JOBSET_BUDGET_CEL, "fieldPath": ".runPolicy",
          "message": "spec.runPolicy.maxRestarts cannot change on a job with spec.backend JobSet (the "
                     "JobSet's failure policy holds the budget); suspend, deadline and TTL can"}]
    return schema


def _max_restarts(obj: str) -> str:
    default = RunPolicy().max_restarts
    return (f"(has({obj}.runPolicy) && has({obj}.runPolicy.maxRestarts) ? "
            f"{obj}.runPolicy.maxRestarts : {default})")


JOBSET_BUDGET_CEL = (f"!has(self.backend) || self.backend != 'JobSet' || "
                     f"{_max_restarts('self')} == {_max_restarts('oldSelf')}")
"""With the JobSet backend the restart budget lives in the JobSet's failure policy, which
JobSet's admission webhook keeps immutable: the RLHFJob's is too."""


def crd() -> dict[str, Any]:
    """The CRD as a dict."""
    status = _schema(RLHFJobStatus)
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step"},
        {"name": "Reward", "type": "number", "jsonPath": ".status.progress.rewardMean"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        # -o wide
        {"name": "Total", "type": "integer", "jsonPath": ".status.progress.totalSteps", "priority": 1},
        {"name": "Checkpoint", "type": "string", "jsonPath": ".status.progress.lastCheckpoint", "priority": 1},
        {"name": "Started", "type": "date", "jsonPath": ".status.startTime", "priority": 1},
        {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
    ]
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status,
        },
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters "
                "(names of the job's pods and services are derived from it)",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": [SHORT_NAME],
                "categories": [CATEGORY],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# GENERATED by `rlhfctl crd` from contract/rlhf_contract/api: do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)
