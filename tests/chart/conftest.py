"""Fixtures of the chart tests: the real `helm` (built with the test control plane by
tests/cluster/build.sh) and Debian's `promtool` / `prometheus` (unpacked by
`make prometheus-tools`). A test whose tool is missing is skipped, saying how to get it."""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlhf-operator"
KUBE_VERSION = "1.34.0"  # helm built from source defaults to v1.20; the chart needs >= 1.30


def _helm_path() -> Path | None:
    out = subprocess.run(["bash", str(REPO / "tests/cluster/build.sh"), "--print"], capture_output=True, text=True)
    path = Path(out.stdout.strip()) / "helm"
    return path if out.returncode == 0 and path.is_file() else None


def prometheus_bin() -> Path | None:
    env = os.environ.get("RLHF_PROMETHEUS_BIN")
    candidates = [env] if env else sorted(glob.glob(os.path.expanduser("~/.cache/rlhf-operator/prometheus-*/usr/bin")))
    for c in reversed(candidates):
        if c and (Path(c) / "promtool").is_file():
            return Path(c)
    return None


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    path = _helm_path()
    if path is None:
        pytest.skip("helm is not built yet: `bash tests/cluster/build.sh` (or `make cluster-bin`) builds it")
    return path


@pytest.fixture(scope="session")
def promtool() -> Path:
    d = prometheus_bin()
    if d is None:
        pytest.skip("promtool is not unpacked: run `make prometheus-tools` (Debian's prometheus package, no install)")
    return d / "promtool"


@pytest.fixture(scope="session")
def render(helm_bin):
    """render(*--set pairs, values=dict) -> list of manifests (dicts); raises CalledProcessError."""

    def run(*sets: str, values: dict | None = None, check: bool = True, tmp: Path | None = None):
        args = [str(helm_bin), "template", "rel", str(CHART), "--namespace", "rlhf-system",
                "--kube-version", KUBE_VERSION]
        for s in sets:
            args += ["--set", s]
        if values is not None:
            f = (tmp or Path(os.environ.get("TMPDIR", "/tmp"))) / f"values-{os.getpid()}.yaml"
            f.write_text(yaml.safe_dump(values))
            args += ["-f", str(f)]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120)
        if check and out.returncode != 0:
            raise AssertionError(f"helm template failed:\n{out.stderr}")
        if not check:
            return out
        return [d for d in yaml.safe_load_all(out.stdout) if d]

    return run


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="session")
def helm_unittest() -> Path:
    out = subprocess.run(["bash", str(REPO / "charts/tools/build.sh"), "--print"], capture_output=True, text=True)
    path = Path(out.stdout.strip()) / "helm-unittest"
    if out.returncode != 0 or not path.is_file():
        pytest.skip("helm-unittest is not built: `make chart-tools` (charts/tools/build.sh) builds it")
    return path
