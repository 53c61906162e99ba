"""The job spec: defaults, validation messages with field paths, overrides, the CRD."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api import JobError, RLHFJob, load_job, validate_job
from rlhf_contract.api.crd import crd, crd_yaml
from rlhf_contract.api.rules import CLUSTER_RULES, IMMUTABLE_FIELDS, MUTABLE_FIELDS, RULES
from rlhf_launcher.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-grpo.yaml"
MINIMAL = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLHFJob",
    "metadata": {"name": "j"},
    "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"}},
}


def problems(data, overrides=()):
    with pytest.raises(JobError) as info:
        validate_job(copy.deepcopy(data), overrides)
    return {p.path: p.message for p in info.value.problems}


def with_spec(**sections):
    data = copy.deepcopy(MINIMAL)
    for key, value in sections.items():
        data["spec"][key] = value
    return data


def test_example_and_defaults():
    job = load_job(EXAMPLE)
    assert job.spec.rollout.replicas == 2 and job.spec.rollout.engine == "cpu"
    minimal = validate_job(copy.deepcopy(MINIMAL))
    assert minimal.spec.rollout.samples_per_prompt == 8
    assert minimal.spec.algorithm.advantage_estimator == "grpo"
    assert minimal.spec.run_policy.max_restarts == 3
    # the resolved config round-trips through the same model (what pods read)
    assert RLHFJob.model_validate(minimal.to_config()) == minimal
    assert minimal.to_config()["spec"]["rollout"]["samplesPerPrompt"] == 8


@pytest.mark.parametrize(
    "data, path, fragment",
    [
        (with_spec(rollout={"replica": 2}), "spec.rollout.replica", "did you mean 'replicas'"),
        (with_spec(rollout={"topP": 1.5}), "spec.rollout.topP", "less than or equal to 1"),
        (with_spec(rollout={"topP": 0.9}), "spec.rollout.topP", "importance ratio would be biased"),
        (with_spec(rollout={"vllm": {"extraArgs": ["--kv-cache-dtipe", "fp8"]}}), "spec.rollout.vllm.extraArgs",
         "not an option of vLLM 0.33.0's `vllm serve` (similar: --kv-cache-dtype"),
        (with_spec(rollout={"vllm": {"extraArgs": ["--dtype=half"]}}), "spec.rollout.vllm.extraArgs",
         "--dtype is set by the operator; use model.dtype instead"),
        (with_spec(rollout={"vllm": {"gpuMemoryUtilization": 1.5}}), "spec.rollout.vllm.gpuMemoryUtilization",
         "less than or equal to 1"),
        (with_spec(rollout={"topK": 50}), "spec.rollout.topP", "got topP=1.0, topK=50"),
        (with_spec(rollout={"samplesPerPrompt": 0}), "spec.rollout.samplesPerPrompt", "greater than or equal to 1"),
        (with_spec(algorithm={"advantageEstimator": "ppo2"}), "spec.algorithm.advantageEstimator", "'grpo'"),
        (with_spec(algorithm={"dualClip": 0.5}), "spec.algorithm.dualClip", "greater than 1"),
        (with_spec(trainer={"learningRate": 0}), "spec.trainer.learningRate", "greater than 0"),
        (with_spec(model={}), "spec.model.path", "required field is missing"),
        ({**MINIMAL, "metadata": {"name": "Bad_Name"}}, "metadata.name", "pattern"),
        ({**MINIMAL, "metadata": {"name": "x" * 41}}, "metadata.name", "at most 40"),
        ({**MINIMAL, "kind": "Job"}, "kind", "'RLHFJob'"),
        # cross-field rules name the field they blame
        (with_spec(rollout={"samplesPerPrompt": 1}), "spec.rollout.samplesPerPrompt", "at least 2"),
        (with_spec(trainer={"nprocPerNode": 2, "parallelism": {"tensorParallel": 4}}),
         "spec.trainer.parallelism", "4 x 1 does not divide 2"),
        (with_spec(algorithm={"numMiniBatches": 3}, schedule={"promptsPerStep": 4}), "spec.algorithm.numMiniBatches", "does not divide 32"),
        (with_spec(schedule={"saveEvery": -1}), "spec.schedule.saveEvery", "greater than or equal to 0"),
        (with_spec(trainer={"engine": "deepspeed", "nprocPerNode": 2, "parallelism": {"contextParallel": 2}}),
         "spec.trainer.engine", "got tensorParallel 1, contextParallel 2"),
        (with_spec(trainer={"engine": "deepspeed", "deepspeed": {"zeroStage": 2, "offloadParams": True}}),
         "spec.trainer.deepspeed.offloadParams", "set trainer.deepspeed.zeroStage: 3"),
        (with_spec(trainer={"engine": "deepspeed", "deepspeed": {"zeroStage": 1}}), "spec.trainer.deepspeed.zeroStage",
         "2 or 3"),
    ],
)
def test_invalid_specs_name_the_field(data, path, fragment):
    found = problems(data)
    assert path in found, found
    assert fragment in found[path]


def test_every_problem_is_reported():
    data = with_spec(rollout={"replica": 2, "topP": 3, "maxTokens": 0})
    assert set(problems(data)) == {"spec.rollout.replica", "spec.rollout.topP", "spec.rollout.maxTokens"}


def test_overrides_are_validated_like_the_file():
    job = validate_job(copy.deepcopy(MINIMAL), ["rollout.replicas=3", "spec.schedule.total_steps=7", "algorithm.klCoef=0.1"])
    assert (job.spec.rollout.replicas, job.spec.schedule.total_steps, job.spec.algorithm.kl_coef) == (3, 7, 0.1)
    assert "spec.rollout.replicas" in problems(MINIMAL, ["rollout.replicas=-1"])
    assert "spec.rollout.nope" in problems(MINIMAL, ["rollout.nope=1"])
    assert "--set" in problems(MINIMAL, ["rollout.replicas"])


def test_cli_validate(tmp_path, capsys):
    assert main(["validate", str(EXAMPLE)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_spec(rollout={"replica": 2, "temperature": -1})))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "spec.rollout.replica: unknown field; did you mean 'replicas'?" in err
    assert "spec.rollout.temperature:" in err
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert main(["validate", str(broken)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_crd_file_is_fresh():
    """crds/rlhfjobs.yaml must be exactly `rlhfctl crd` (regenerate with `make crd`)."""
    out = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "crd"], capture_output=True, text=True, check=True).stdout
    assert out == (ROOT / "crds" / "rlhfjobs.yaml").read_text(), "crds/rlhfjobs.yaml is stale: run `make crd`"


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")


def test_crd_is_structural_and_carries_the_rules():
    doc = crd()
    version = doc["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title", "const"} & set(node), path
        if "properties" in node and not path.endswith("/properties"):
            assert node.get("type") == "object", path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
    spec = schema["properties"]["spec"]
    rules = [v["rule"] for v in spec["x-kubernetes-validations"]]
    assert rules[:len(RULES)] == [r.cel for r in RULES]
    n = len(RULES) + len(CLUSTER_RULES)  # then what the operator cannot build yet
    assert rules[len(RULES):n] == [r.cel for r in CLUSTER_RULES]
    transitions = spec["x-kubernetes-validations"][n:]
    *transitions, jobset_budget = transitions
    assert jobset_budget["fieldPath"] == ".runPolicy" and "oldSelf" in jobset_budget["rule"]
    assert [t["fieldPath"] for t in transitions] == [f".{f}" for f in IMMUTABLE_FIELDS]
    assert all("oldSelf" in t["rule"] and t["message"].startswith(f"spec.{f} cannot change")
               for t, f in zip(transitions, IMMUTABLE_FIELDS))
    assert spec["properties"]["rollout"]["properties"]["samplesPerPrompt"] == {
        "default": 8, "description": "Responses sampled for each prompt (the group size).", "minimum": 1,
        "maximum": 2**31 - 1, "type": "integer", "format": "int64"}
    assert spec["required"] == ["model", "data"]
    assert spec["properties"]["algorithm"]["properties"]["dualClip"]["nullable"] is True
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == ["Phase", "Step", "Reward", "Restarts", "Age"]
    assert [c["name"] for c in columns if c.get("priority") == 1] == ["Total", "Checkpoint", "Started", "Message"]  # -o wide
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    # the API conventions: a list map keyed by type, a transition time always
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert {"type", "status", "lastTransitionTime"} <= set(conditions["items"]["required"])
    assert conditions["items"]["properties"]["lastTransitionTime"]["format"] == "date-time"
    assert "observedGeneration" in conditions["items"]["properties"]
    assert doc["spec"]["names"]["shortNames"] == ["rlj"]
    # its own category (`kubectl get rlhf`), never `all`: `kubectl delete all` must not delete jobs
    assert doc["spec"]["names"]["categories"] == ["rlhf"]
    # `kubectl explain rlhfjob.status...` has text for every field
    fields = {p: n for p, n in _walk(schema["properties"]["status"]) if p.split("/")[-2:-1] == ["properties"]}
    assert len(fields) > 20 and "/properties/progress/properties/rewardMean" in fields
    assert not [p for p, n in fields.items() if not n.get("description")]
    assert version["subresources"] == {"status": {}}
    assert yaml.safe_load(crd_yaml()) == doc


def test_every_spec_field_is_either_mutable_or_immutable():
    """A new spec field must be classified: can the operator apply a change of it live?"""
    from rlhf_contract.api.models import RLHFJobSpec

    names = {f.alias or n for n, f in RLHFJobSpec.model_fields.items()}
    assert not set(MUTABLE_FIELDS) & set(IMMUTABLE_FIELDS)
    assert set(MUTABLE_FIELDS) | set(IMMUTABLE_FIELDS) == names
