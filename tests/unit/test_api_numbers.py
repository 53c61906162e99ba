"""Every number of the API models refuses what cannot be a setting: a boolean, NaN,
infinity, an integer beyond int64 (what the API server stores), and the CRD carries the
same bounds. The fields are found by walking the models, so a new field is covered."""

from __future__ import annotations

import copy
import typing
from typing import Any, Iterator

import pytest
from pydantic import BaseModel

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.api.common import INT_MAX, Method, number_kind
from rlhf_contract.api.crd import crd
from rlhf_contract.api.models import RLHFJobSpec, RLHFJobStatus
from rlhf_launcher.cli import main

JOB = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLHFJob",
    "metadata": {"name": "j"},
    "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"}},
}


def _submodel(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (directly, optionally, or as list items), and whether in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    for arg in typing.get_args(annotation):
        found, many = _submodel(arg)
        if found is not None:
            return found, many or typing.get_origin(annotation) is list
    return None, False


def numeric_fields(model: type[BaseModel], path: tuple) -> Iterator[tuple[tuple, type]]:
    """(path, int or float) of every number under `model`; a list item is the step `0`."""
    for name, info in model.model_fields.items():
        step = (*path, info.alias or name)
        kind = number_kind(info.annotation)
        if kind is not None:
            yield step, kind
        items = [number_kind(typing.get_args(a)[0].__origin__ if typing.get_origin(typing.get_args(a)[0])
                             is typing.Annotated else typing.get_args(a)[0])
                 for a in (info.annotation, *typing.get_args(info.annotation)) if typing.get_origin(a) is list]
        if items and items[0] is not None:  # a list of numbers (supplementalGroups): its items
            yield (*step, 0), items[0]
        found, many = _submodel(info.annotation)
        if found is not None:
            yield from numeric_fields(found, (*step, 0) if many else step)


FIELDS = [*numeric_fields(RLHFJobSpec, ("spec",)), *numeric_fields(RLHFJobStatus, ("status",))]
BAD = {"true": True, "NaN": float("nan"), "infinity": float("inf"), "-infinity": float("-inf")}


def dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))


def job_with(path: tuple, value: Any) -> dict:
    data = copy.deepcopy(JOB)
    node: Any = data
    for part, nxt in zip(path, path[1:]):
        if isinstance(nxt, int):
            node = node.setdefault(part, [{}])
        elif isinstance(part, int):
            node = node[part]
        else:
            node = node.setdefault(part, {})
    node[path[-1]] = value
    return data


def refusals(path: tuple, value: Any) -> dict[str, str]:
    """Problems of the job with `value` at `path`: through `--set` (YAML text, as a user types
    it) when no list is on the way, else in the document."""
    if 0 in path or path[0] != "spec":
        data, overrides = job_with(path, value), []
    else:
        text = {True: "true"}.get(value, repr(value).replace("nan", ".nan").replace("inf", ".inf"))
        data, overrides = copy.deepcopy(JOB), [f"{dotted(path)}={text}"]
    with pytest.raises(JobError) as info:
        validate_job(data, overrides)
    return {p.path: p.message for p in info.value.problems}


def test_the_walk_finds_the_numbers():
    names = {dotted(p) for p, _ in FIELDS}
    assert {"spec.trainer.learningRate", "spec.schedule.totalSteps", "spec.reward.components[0].weight",
            "spec.evaluation.datasets[0].maxPrompts", "status.progress.rewardMean"} <= names
    assert len(names) == len(FIELDS) > 70


@pytest.mark.parametrize("path, kind", FIELDS, ids=[dotted(p) for p, _ in FIELDS])
def test_every_number_refuses_what_cannot_be_a_setting(path, kind):
    where = dotted(path)
    for what, value in BAD.items():
        found = refusals(path, value)
        assert where in found, f"{where} accepted {what}: {found}"
    assert "must be a number, not true" in refusals(path, True)[where]
    if kind is int:
        assert where in refusals(path, INT_MAX + 1), f"{where} accepted {INT_MAX + 1}"
        assert where in refusals(path, 2**63), f"{where} accepted 2^63"
        assert where in refusals(path, 1e30), f"{where} accepted 1e30"
        assert "must be an integer" in refusals(path, "12")[where]


def test_a_float_beyond_float64_is_refused_as_typed():
    """YAML reads 1e400 as text; it parses to infinity, which is refused."""
    with pytest.raises(JobError) as info:
        validate_job(copy.deepcopy(JOB), ["trainer.learningRate=1e400"])
    assert [p.path for p in info.value.problems] == ["spec.trainer.learningRate"]


@pytest.mark.parametrize("override, fragment", [
    ("trainer.learningRate=0", "greater than 0"),
    ("schedule.promptsPerStep=0", "greater than or equal to 1"),
    ("rollout.temperature=0", "greater than 0"),
    ("schedule.seed=-1", "greater than or equal to 0"),
    ("schedule.seed=4294967296", "less than or equal to 4294967295"),
    ("rollout.replicas=2147483648", "less than or equal to 2147483647"),
    ("rollout.requestTimeoutSeconds=1e12", "less than or equal to 2147483647"),
])
def test_values_that_cannot_work(override, fragment):
    path = "spec." + override.split("=")[0]
    with pytest.raises(JobError) as info:
        validate_job(copy.deepcopy(JOB), [override])
    found = {p.path: p.message for p in info.value.problems}
    assert fragment in found[path], found


def test_cli_names_the_field(capsys):
    job = "examples/local-grpo.yaml"
    assert main(["validate", job, "--set", "spec.algorithm.klCoef=.nan", "--set", "schedule.totalSteps=true"]) == 2
    err = capsys.readouterr().err
    assert "spec.algorithm.klCoef: Input should be a finite number" in err
    assert "spec.schedule.totalSteps: must be a number, not true" in err


def _crd_nodes(node: dict, path: str) -> Iterator[tuple[str, dict]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _crd_nodes(child, f"{path}.{name}")
    if "items" in node:
        yield from _crd_nodes(node["items"], f"{path}[0]")


def test_crd_bounds_every_integer_as_int64():
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    nodes = dict(_crd_nodes(root, ""))
    ints = {p[1:]: n for p, n in nodes.items() if n.get("type") == "integer"}
    enums = {p for p, n in ints.items() if "enum" in n}  # e.g. zeroStage: 2 or 3
    assert {dotted(p) for p, k in FIELDS if k is int} == set(ints) - enums
    for path, node in ints.items():
        if path in enums:
            continue
        assert node["format"] == "int64", path
        assert -(2**63) <= node["minimum"] and node["maximum"] <= INT_MAX, path
        assert float(node["maximum"]) < 2**63, path  # the API server reads the bound as a float64
    floats = {p[1:] for p, n in nodes.items() if n.get("type") == "number"}
    assert {dotted(p) for p, k in FIELDS if k is float} == floats


def test_method_is_one_enum():
    job = validate_job(copy.deepcopy(JOB), ["method=sft"])
    assert job.spec.method is Method.SFT and job.spec.method == "sft" and job.spec.offline
    assert job.to_config()["spec"]["method"] == "sft"
    root = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert root["properties"]["spec"]["properties"]["method"]["enum"] == [m.value for m in Method]
