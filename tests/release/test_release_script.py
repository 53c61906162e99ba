"""hack/release.sh (`make release`) against a real OCI registry (distribution, plain HTTP on
loopback: tests/cluster/registry.py): the chart it pushes is pulled back with helm and carries
the operator image by tag and digest; the sdist and the wheel are built; bad input is refused
with what to change. The images themselves are not built here: the lock file names digests
that only the chart's values carry (installing that chart on a real node is
tests/cluster/'s part)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from cluster.registry import Registry

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "release.sh"
CHART = REPO / "charts" / "rlhf-operator"
IMAGES = ("operator", "trainer", "inference", "colocated")
PREFIX = "release-test"


def version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]


def built_dir(script: str) -> Path:
    out = subprocess.run(["bash", str(REPO / script), "--print"], capture_output=True, text=True)
    return Path(out.stdout.strip())


@pytest.fixture(scope="module")
def helm() -> Path:
    path = built_dir("tests/cluster/build.sh") / "helm"
    if not path.is_file():
        pytest.skip(f"helm is not built yet ({path}): bash tests/cluster/build.sh (make cluster-bin) builds it")
    return path


@pytest.fixture(scope="module")
def registry(tmp_path_factory, helm):
    tools = built_dir("tests/cluster/node/build.sh")
    if not (tools / ".complete").is_file() or not (tools / "bin" / "registry").is_file():
        pytest.skip(f"the registry binary is not built yet ({tools}/bin/registry): bash tests/cluster/node/build.sh")
    reg = Registry.start(tmp_path_factory.mktemp("registry"), tools=tools)
    yield reg
    reg.stop()


def fake_lock(path: Path, registry: str, ver: str, **entries) -> dict:
    lock = {name: {"image": f"{registry}/{name}:{ver}",
                   "digest": "sha256:" + hashlib.sha256(f"{name} {ver}".encode()).hexdigest()} for name in IMAGES}
    lock.update(entries)
    path.write_text(json.dumps({k: v for k, v in lock.items() if v is not None}, indent=2))
    return lock


def release(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "PLAIN_HTTP", "IMAGES_LOCK", "HELM", "DIST")}
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**base, "DIST": str(tmp_path / "dist"), **env})


@pytest.fixture
def repo(registry):
    """A path in the module's own registry (a store of its own, on a free port)."""
    return f"{registry.host}/{PREFIX}"


def test_release_publishes_the_chart_pinned_to_the_operator_digest(registry, repo, helm, tmp_path):
    ver = version()
    lock = fake_lock(tmp_path / "images.lock.json", repo, ver)
    values_before = (CHART / "values.yaml").read_text()
    out = release({"REGISTRY": repo, "PLAIN_HTTP": "1", "IMAGES_LOCK": str(tmp_path / "images.lock.json"),
                   "HELM": str(helm)}, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (CHART / "values.yaml").read_text() == values_before  # the repository's chart is left alone

    # what helm push printed is what the registry holds, and the summary says it
    chart_digest = registry.digest(f"{PREFIX}/charts/rlhf-operator", ver)
    assert chart_digest and chart_digest.startswith("sha256:")
    operator = f"{repo}/operator:{ver}@{lock['operator']['digest']}"
    assert f"chart   oci://{repo}/charts/rlhf-operator:{ver}@{chart_digest}" in out.stdout
    for name in IMAGES:
        assert f"image   {repo}/{name}:{ver}@{lock[name]['digest']}" in out.stdout
    record = json.loads((tmp_path / "dist" / "release.json").read_text())
    assert record["chart"]["digest"] == chart_digest and record["images"]["operator"]["ref"] == operator

    # the chart as a user gets it: its values and the Deployment it renders
    ref = f"oci://{repo}/charts/rlhf-operator"
    shown = subprocess.run([str(helm), "show", "values", ref, "--version", ver, "--plain-http"],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    values = yaml.safe_load(shown.stdout)
    assert values["image"] == {"repository": f"{repo}/operator", "tag": ver, "digest": lock["operator"]["digest"],
                               "pullPolicy": "IfNotPresent"}
    assert values["trainingRuntime"]["image"]["repository"] == f"{repo}/trainer"
    assert "# -- Image digest (`sha256:...`)" in shown.stdout  # comments kept: `helm show values` documents the keys
    original = yaml.safe_load(values_before)
    for key in ("image", "trainingRuntime"):
        values.pop(key), original.pop(key)
    assert values == original  # nothing else changed
    rendered = subprocess.run([str(helm), "template", "rel", ref, "--version", ver, "--plain-http",
                               "--kube-version", "1.34.0", "--show-only", "templates/deployment.yaml"],
                              capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    assert yaml.safe_load(rendered.stdout)["spec"]["template"]["spec"]["containers"][0]["image"] == operator

    # the Python package: torch only in the `plan` extra (and the trainer's and inference's)
    wheel = tmp_path / "dist" / f"rlhf_operator-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"rlhf_operator-{ver}.dist-info/METADATA").decode()
    assert {"rlhf_launcher/cli.py", "rlhf_contract/images.py", "rlhf_trainer/preflight/data.py"} <= names
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert "httpx==0.28.1" in requires and 'torch==2.14.0; extra == "plan"' in requires, requires
    assert not [r for r in requires if r.startswith("torch") and "extra ==" not in r], requires
    with tarfile.open(tmp_path / "dist" / f"rlhf_operator-{ver}.tar.gz") as sdist:
        assert f"rlhf_operator-{ver}/pyproject.toml" in sdist.getnames()
    assert record["python"]["wheel"]["sha256"] == "sha256:" + hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_bad_input_names_what_to_change(tmp_path):
    """Refused before anything is built or pushed (no helm or registry needed: HELM is any executable)."""
    repo = "127.0.0.1:5999/rlhf-operator"
    out = release({"HELM": "/bin/true"}, tmp_path)
    assert out.returncode == 2 and "REGISTRY is not set" in out.stderr, out.stderr
    out = release({"REGISTRY": f"oci://{repo}", "HELM": "/bin/true"}, tmp_path)
    assert out.returncode == 2 and "without a scheme" in out.stderr, out.stderr
    out = release({"REGISTRY": repo, "HELM": str(tmp_path / "no-helm")}, tmp_path)
    assert out.returncode == 2 and f"HELM={tmp_path / 'no-helm'} is not an executable" in out.stderr, out.stderr
    out = release({"REGISTRY": repo, "HELM": "/bin/true", "IMAGES_LOCK": str(tmp_path / "missing.json")}, tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"IMAGES_LOCK={tmp_path / 'missing.json'} does not exist: build and push the images first " \
           f"(make images IMAGE_REGISTRY={repo}" in out.stderr
    ver = version()
    fake_lock(tmp_path / "lock.json", repo, ver, colocated=None,
              trainer={"image": f"ghcr.io/rlhf-operator/trainer:{ver}", "digest": "sha256:" + "a" * 64},
              inference={"image": f"{repo}/inference:{ver}", "digest": "latest"})
    out = release({"REGISTRY": repo, "HELM": "/bin/true", "IMAGES_LOCK": str(tmp_path / "lock.json")}, tmp_path)
    assert out.returncode == 2, out.stderr
    assert f"trainer.image is 'ghcr.io/rlhf-operator/trainer:{ver}', this release needs '{repo}/trainer:{ver}'" \
        in out.stderr
    assert "inference.digest is 'latest', not a sha256:<64 hex> manifest digest" in out.stderr
    assert f"colocated: missing (build and push it: make images IMAGE_REGISTRY={repo})" in out.stderr
    assert not (tmp_path / "dist").exists()  # nothing written
