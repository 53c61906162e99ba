"""helm-unittest suites (charts/rlhf-operator/tests/<template>_test.yaml): one per
template, each `it:` naming the value it tests; run with --strict."""

from __future__ import annotations

import subprocess

from .conftest import CHART


def test_every_template_has_a_suite():
    templates = {p.stem for p in (CHART / "templates").glob("*.yaml")}
    suites = {p.name.removesuffix("_test.yaml") for p in (CHART / "tests").glob("*_test.yaml")}
    assert templates == suites, f"templates without a suite: {sorted(templates - suites)}"


def test_helm_unittest_suites_pass(helm_unittest):
    out = subprocess.run([str(helm_unittest), "--strict", str(CHART)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr
    suites = len(list((CHART / "tests").glob("*_test.yaml")))
    assert f"Test Suites: {suites} passed, {suites} total" in out.stdout, out.stdout[-2000:]
