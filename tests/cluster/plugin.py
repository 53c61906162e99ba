"""Pytest plugin: the `cluster` session fixture, a real control plane (see harness.py), for
tests marked `@pytest.mark.cluster`.

tests/cluster/conftest.py loads it for the tests under tests/cluster/. Tests elsewhere
(e.g. tests/e2e/) get the fixture by `pytest_plugins = ["cluster.plugin"]` in
tests/conftest.py (then drop the import from tests/cluster/conftest.py).

- If a cluster started with `make cluster` is running in `.cluster/` (or $RLHF_CLUSTER_DIR),
  the tests use it and leave it running.
- Otherwise the fixture starts one there (building the binaries first if they are not in
  the cache) and stops it at the end of the session. Logs stay in `.cluster/logs/`.
- A failed cluster test gets the tail of every control-plane log in its report.
"""

from __future__ import annotations

import os

import pytest

from .harness import DEFAULT_DIR, KUBE_ORDER, Cluster, ensure_binaries

_STATE: dict[str, Cluster] = {}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cluster: needs the real Kubernetes control plane (tests/cluster/harness.py)")
    config.addinivalue_line(
        "markers", "cluster_last: run after every other test (soak checks of the shared cluster)")
    config.addinivalue_line(
        "markers", "realnode: runs real pods on the real node (tests/cluster/realnode.py; root, `make test-images`)")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: item.get_closest_marker("cluster_last") is not None)  # stable


def pytest_collection_finish(session):
    # Build (or find) the binaries before any test runs, outside the per-test timeout:
    # a cold build takes longer than one test may.
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("cluster") for item in session.items):
        capman = session.config.pluginmanager.getplugin("capturemanager")
        ctx = capman.global_and_fixture_disabled() if capman else _nullcontext()
        with ctx:
            ensure_binaries()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    root = os.environ.get("RLHF_CLUSTER_DIR", str(DEFAULT_DIR))
    existing = Cluster.attach(root)
    if existing is not None:
        _STATE["cluster"] = existing
        yield existing
        return
    c = Cluster(root, bin_dir=ensure_binaries())
    c.start(nodes=int(os.environ.get("RLHF_CLUSTER_NODES", "4")))
    _STATE["cluster"] = c
    try:
        yield c
    finally:
        c.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and item.get_closest_marker("cluster") and "cluster" in _STATE:
        c = _STATE["cluster"]
        for name in KUBE_ORDER:
            report.sections.append((f"control plane log: {name}", c.log_tail(name, 60)))
    return report
