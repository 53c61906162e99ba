"""What a team gets from `pip install rlhf-operator`: the project installed (not editable) into
a bare virtual environment with uv, from a copy of this checkout's files, then `rlhfctl`'s
`--version`, `--help`, `validate`, `render` and `crd` as a user runs them. torch stays out:
`plan` says which extra it needs (it measures the model with torch), and with that extra
(`rlhf-operator[plan]`) it plans.

uv installs from its cache (~/.cache/uv; PyPI when a wheel is not there yet)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
EXAMPLES = REPO / "examples"


def uv() -> str:
    path = REPO / ".venv" / "bin" / "uv"
    found = str(path) if path.is_file() else shutil.which("uv")
    if not found:
        pytest.skip("uv is not installed (make venv installs it into .venv/)")
    return found


def clean_env() -> dict[str, str]:
    """The environment without what would let the venv see this checkout or another venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
            and not k.startswith("UV_PYTHON")}


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore): no build/ or
    egg-info leftovers, and no build in the working tree that another test may be using."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def make_venv(root: Path, requirement: str, *args: str) -> tuple[Path, subprocess.CompletedProcess]:
    venv = root / "venv"
    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=clean_env())
    install = subprocess.run([uv(), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), *args,
                              requirement], capture_output=True, text=True, env=clean_env(), timeout=900)
    return venv, install


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return checkout_copy(tmp_path_factory.mktemp("checkout"))


@pytest.fixture(scope="module")
def bare(tmp_path_factory, source) -> Path:
    venv, install = make_venv(tmp_path_factory.mktemp("bare"), str(source))
    assert install.returncode == 0, install.stderr
    return venv


def rlhfctl(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "rlhfctl"), *args], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(), timeout=300)


def test_installed_as_a_package_without_torch(bare, tmp_path):
    probe = subprocess.run([str(bare / "bin" / "python"), "-c", (
        "import importlib.util, json, rlhf_launcher.cli, rlhf_trainer, rlhf_operator, rlhf_contract\n"
        "print(json.dumps({'cli': rlhf_launcher.cli.__file__,"
        " 'missing': [m for m in ('torch', 'deepspeed', 'vllm', 'kopf') if importlib.util.find_spec(m)]}))")],
        capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert Path(found["cli"]).is_relative_to(bare), found  # the venv's own copy, not this checkout
    assert found["missing"] == [], f"the base install pulled {found['missing']}"


def test_version_and_help(bare, tmp_path):
    out = rlhfctl(bare, "--version", cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith(f"rlhfctl {VERSION} (trainer image "), out
    out = rlhfctl(bare, "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for command in ("run", "validate", "plan", "render", "submit", "get", "crd"):
        assert f"    {command} " in out.stdout or f"    {command}\n" in out.stdout, (command, out.stdout)


@pytest.mark.parametrize("example,name", [("local-grpo.yaml", "local-grpo"), ("rlhfjob.yaml", "qwen-math-grpo"),
                                          ("local-sft.yaml", "local-sft")])
def test_validate_examples(bare, tmp_path, example, name):
    out = rlhfctl(bare, "validate", str(EXAMPLES / example), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{EXAMPLES / example}: valid RLHFJob {name!r}"
    assert "Traceback" not in out.stderr and "PyTorch was not found" not in out.stderr, out.stderr


def test_validate_reads_parquet_and_measures_prompts(bare, tmp_path):
    """The trainer's data checks run here as in the pod: a Parquet file is read (pyarrow, from
    datasets) and its prompts are measured with the model's tokenizer (transformers, no torch)."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "3714:", "answer": "4"}] * 8), data)
    job = str(EXAMPLES / "local-grpo.yaml")
    out = rlhfctl(bare, "validate", job, "--set", f"data.path={data}", "-o", "json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["valid"] is True
    pq.write_table(pa.Table.from_pylist([{"prompt": "3714:" * 10, "answer": "4"}] * 8), data)  # 50 tokens > 16
    out = rlhfctl(bare, "validate", job, "--set", f"data.path={data}", cwd=tmp_path)
    assert out.returncode == 2 and "maxPromptLength" in out.stderr, out.stderr


def test_validate_refuses_a_bad_field(bare, tmp_path):
    out = rlhfctl(bare, "validate", str(EXAMPLES / "local-grpo.yaml"), "--set", "rollout.replicas=0", cwd=tmp_path)
    assert out.returncode == 2
    assert "spec.rollout.replicas: Input should be greater than or equal to 1" in out.stderr


@pytest.mark.parametrize("backend,workloads", [("PyTorchJob", {"PyTorchJob", "StatefulSet"}), ("JobSet", {"JobSet"})])
def test_render(bare, tmp_path, backend, workloads):
    out = rlhfctl(bare, "render", str(EXAMPLES / "rlhfjob.yaml"), "--backend", backend, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    kinds = {d["kind"] for d in docs}
    assert workloads | {"ConfigMap", "NetworkPolicy", "ServiceAccount"} <= kinds, kinds
    assert all(d["metadata"]["name"].startswith("qwen-math-grpo") for d in docs)
    assert f"image: ghcr.io/rlhf-operator/trainer:{VERSION}" in out.stdout
    assert f"image: ghcr.io/rlhf-operator/inference:{VERSION}" in out.stdout


def test_submit_dry_run(bare, tmp_path):
    """`submit --dry-run` prints what it would send (kubernetes is a base dependency); no cluster needed."""
    out = rlhfctl(bare, "submit", str(EXAMPLES / "rlhfjob.yaml"), "--dry-run", "-o", "yaml", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job = next(yaml.safe_load_all(out.stdout))
    assert (job["kind"], job["metadata"]["name"]) == ("RLHFJob", "qwen-math-grpo")


def test_crd(bare, tmp_path):
    out = rlhfctl(bare, "crd", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    crd = yaml.safe_load(out.stdout)
    assert crd["kind"] == "CustomResourceDefinition" and crd["metadata"]["name"] == "rlhfjobs.rlhf.dev"
    assert crd == yaml.safe_load((REPO / "crds/rlhfjobs.yaml").read_text())


def test_plan_names_the_extra_it_needs(bare, tmp_path):
    out = rlhfctl(bare, "plan", str(EXAMPLES / "local-grpo.yaml"), "--gpu-memory-gib", "80", cwd=tmp_path)
    assert out.returncode == 1, out
    assert "torch is not installed here: pip install 'rlhf-operator[plan]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_plan_extra_plans(tmp_path, source):
    """`rlhf-operator[plan]` adds torch (and peft), from uv's cache only: the ~4 GiB torch wheel
    set is not downloaded for a test (`make venv` puts it in the cache)."""
    venv, install = make_venv(tmp_path, f"{source}[plan]", "--offline")
    if install.returncode != 0 and ("offline" in install.stderr.lower() or "cache" in install.stderr.lower()):
        pytest.skip(f"torch is not in uv's cache (make venv puts it there): {install.stderr.strip()[-300:]}")
    assert install.returncode == 0, install.stderr
    for example in ("local-grpo.yaml", "local-sft.yaml"):
        out = rlhfctl(venv, "plan", str(EXAMPLES / example), "--gpu-memory-gib", "80", "-o", "json", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        plan = json.loads(out.stdout)
        assert plan["fits"] is True and plan["gpuBytes"] == 80 << 30 and 0 < plan["totalBytes"] < plan["gpuBytes"]
        names = [t["name"] for t in plan["terms"]]
        assert "activations" in names and any(n.startswith("policy weights") for n in names), names
