"""A release is one version: the Python package, the images' tags (contract/rlhf_contract/images.py),
the chart and its appVersion (the operator image's default tag), each with a CHANGELOG.md entry;
`rlhfctl --version` reports the installed package's. (tests/unit/test_images.py checks that the
spec's defaults, the examples and `make images` name the contract's tags.)"""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from rlhf_contract import images

ROOT = Path(__file__).resolve().parents[2]


def release_versions() -> dict[str, str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    chart = yaml.safe_load((ROOT / "charts/rlhf-operator/Chart.yaml").read_text())
    return {"pyproject.toml [project] version": pyproject["project"]["version"],
            "contract/rlhf_contract/images.py VERSION": images.VERSION,
            "charts/rlhf-operator/Chart.yaml version": chart["version"],
            "charts/rlhf-operator/Chart.yaml appVersion": str(chart["appVersion"])}


def test_package_images_and_chart_have_one_version():
    versions = release_versions()
    assert len(set(versions.values())) == 1, f"set these to one version: {versions}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", images.VERSION), "a release version is MAJOR.MINOR.PATCH (SemVer, as Helm wants)"


def test_the_changelog_has_the_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[Unreleased\]$", text, re.M), "CHANGELOG.md: keep an `## [Unreleased]` section on top"
    assert re.search(rf"^## \[{re.escape(images.VERSION)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), \
        f"CHANGELOG.md has no `## [{images.VERSION}] - YYYY-MM-DD` entry for this version"


def test_rlhfctl_version_is_the_installed_packages(capsys):
    from rlhf_launcher.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rlhfctl {version('rlhf-operator')} (trainer image {images.TRAINER_IMAGE}, "), out
    # the venv's metadata is this checkout's (after a version bump: reinstall, as `make` does)
    assert version("rlhf-operator") == images.VERSION
