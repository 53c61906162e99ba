"""Loads the control-plane plugin (fixture `cluster`, marker `cluster`) for tests/cluster/."""

from .plugin import _STATE, cluster, pytest_collection_finish, pytest_configure, pytest_runtest_makereport  # noqa: F401
