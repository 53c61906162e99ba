"""The images exist as Dockerfiles, and the spec's defaults, the examples, the CRD, the
Dockerfiles and `make images` name the same tags (contract/rlhf_contract/images.py)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

from rlhf_contract import images
from rlhf_contract.api.models import RolloutSpec, TrainerSpec

ROOT = Path(__file__).resolve().parents[2]


def make_vars() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    return dict(re.findall(r"^(\w+) \?= (\S+)$", text, re.M))


def dockerfile_args(path: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (ROOT / path).read_text(), re.M))


def test_version_is_the_packages():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert images.VERSION == pyproject["project"]["version"]


def test_spec_defaults_are_our_images():
    assert RolloutSpec().image == images.INFERENCE_IMAGE == f"{images.REGISTRY}/inference:{images.VERSION}"
    assert TrainerSpec().image == images.TRAINER_IMAGE
    crd = (ROOT / "crds/rlhfjobs.yaml").read_text()
    assert f"default: {images.INFERENCE_IMAGE}" in crd and f"default: {images.TRAINER_IMAGE}" in crd


def test_examples_name_the_same_images():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())["spec"]
        if "image" in spec.get("rollout", {}):
            assert spec["rollout"]["image"] == images.INFERENCE_IMAGE, path
        if "image" in spec.get("trainer", {}):
            assert spec["trainer"]["image"] == images.TRAINER_IMAGE, path


def test_make_images_builds_the_contract_tags_from_the_pinned_vllm():
    import importlib.util

    v = make_vars()
    assert v["IMAGE_REGISTRY"] == images.REGISTRY and v["IMAGE_VERSION"] == images.VERSION
    assert v["VLLM_BASE_IMAGE"] == images.VLLM_BASE_IMAGE == f"vllm/vllm-openai:v{images.VLLM_VERSION}"
    recipe = (ROOT / "Makefile").read_text().split("\nimages:")[1].split("\n\n")[0]
    assert "hack/images.py" in recipe and "VLLM_BASE_IMAGE=$(VLLM_BASE_IMAGE)" in recipe
    spec = importlib.util.spec_from_file_location("hack_images", ROOT / "hack" / "images.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    assert builder.contract_defaults() == (images.REGISTRY, images.VERSION)
    tags = {builder.DOCKERFILES[n]: f"{images.REGISTRY}/{n}:{images.VERSION}" for n in builder.IMAGES}
    assert tags == {"operator/Dockerfile": images.OPERATOR_IMAGE, "trainer_image/Dockerfile": images.TRAINER_IMAGE,
                    "inference_image/Dockerfile": images.INFERENCE_IMAGE,
                    "colocated_image/Dockerfile": images.COLOCATED_IMAGE}


def test_dockerfiles_are_pinned_and_layered():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hack_requirements", ROOT / "hack" / "requirements.py")
    reqs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reqs)
    inference = (ROOT / "inference_image/Dockerfile").read_text()
    assert dockerfile_args("inference_image/Dockerfile") == {"VLLM_BASE_IMAGE": images.VLLM_BASE_IMAGE}
    assert "FROM ${VLLM_BASE_IMAGE}" in inference and "pip install" not in inference  # vLLM keeps its torch
    trainer_base = dockerfile_args("trainer_image/Dockerfile")["TORCH_BASE_IMAGE"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch_pin = next(d for d in pyproject["project"]["optional-dependencies"]["trainer"] if d.startswith("torch=="))
    assert trainer_base.startswith(f"pytorch/pytorch:{torch_pin.removeprefix('torch==')}-cuda")
    for path, extras in (("trainer_image/Dockerfile", ["trainer", "gem"]), ("operator/Dockerfile", ["operator"]),
                         ("colocated_image/Dockerfile", ["trainer"])):
        text = (ROOT / path).read_text()
        # dependencies in a layer of their own, then our packages without them
        got = re.search(r"requirements\.py \S+pyproject\.toml ([a-z ]+) >", text)
        assert got and got.group(1).split() == extras, path
        assert text.index("requirements.py") < text.index("COPY contract") < text.index("--no-deps .")
        resolved = reqs.requirements(str(ROOT / "pyproject.toml"), extras)
        assert all("==" in r for r in resolved), resolved  # every one pinned
    assert "torch==" not in "\n".join(reqs.requirements(str(ROOT / "pyproject.toml"), ["operator"]))
    operator = (ROOT / "operator/Dockerfile").read_text()
    assert "find_spec('torch') is None" in operator
    colocated = (ROOT / "colocated_image/Dockerfile").read_text()
    # the inference image's base (vLLM untouched), the trainer in a venv beside it
    assert dockerfile_args("colocated_image/Dockerfile") == {"VLLM_BASE_IMAGE": images.VLLM_BASE_IMAGE}
    assert "FROM ${VLLM_BASE_IMAGE}" in colocated and "/opt/trainer/bin/pip install" in colocated
    for path in ("operator/Dockerfile", "trainer_image/Dockerfile", "inference_image/Dockerfile", "colocated_image/Dockerfile"):
        for base in dockerfile_args(path).values():
            assert ":" in base and not base.endswith(":latest"), f"{path}: unpinned base {base}"


def test_images_run_as_a_non_root_user_and_the_build_context_leaves_out_the_environment():
    from rlhf_contract.api.common import RUN_AS_USER  # the pods' uid unless securityContext.runAsUser

    for path in ("operator/Dockerfile", "trainer_image/Dockerfile", "inference_image/Dockerfile",
                 "colocated_image/Dockerfile"):
        users = re.findall(r"^USER (\d+)(?::(\d+))?$", (ROOT / path).read_text(), re.M)
        assert users and int(users[-1][0]) != 0, f"{path}: the last USER must be a non-root uid"
        if path != "operator/Dockerfile":
            assert int(users[-1][0]) == RUN_AS_USER  # what the operator's pods run as
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", "runs"} <= ignored
    copied = {m for path in ("operator/Dockerfile", "trainer_image/Dockerfile", "inference_image/Dockerfile",
                             "colocated_image/Dockerfile")
              for m in re.findall(r"^COPY (\S+)", (ROOT / path).read_text(), re.M)}
    assert copied and not any(c.split("/")[0] in ignored for c in copied)  # nothing a Dockerfile needs is left out
