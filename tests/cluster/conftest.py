"""Loads the control-plane plugin (fixture `cluster`, marker `cluster`) for tests/cluster/."""

from .plugin import (  # noqa: F401
    _STATE, cluster, pytest_collection_finish, pytest_collection_modifyitems, pytest_configure,
    pytest_runtest_makereport,
)
