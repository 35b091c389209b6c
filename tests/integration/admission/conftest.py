"""One cluster with the default configuration (ClusterConfig's: 1 prefill + 1
decode replica, default admission; what a bare `pdcluster up` starts on a
machine with more than 2 cores), for the tests of what it serves and refuses
(issue 32).  The disaggregated layout is what these tests are about (a dead
prefill pool, placement between pools), whatever the machine."""

from __future__ import annotations

import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.cli.default_layout import default_layout, usable_cores
from pdcluster.services.config import ClusterConfig
from tests.integration.cluster.conftest import directory_cluster, stop_after_directory

_RUNNING: list = []


@pytest.fixture(scope="session")
def default_cluster(shared_ray):
    yield from directory_cluster(shared_ray, ClusterConfig(port=free_service_port()), _RUNNING)


@pytest.fixture(scope="session")
def default_url(default_cluster) -> str:
    return f"http://127.0.0.1:{default_cluster.config.port}"


@pytest.fixture(scope="session")
def bare_up_cluster(shared_ray):
    """What a bare `pdcluster up` starts on this machine (its layout follows the cores:
    pdcluster/services/cli/default_layout.py)."""
    layout = default_layout(usable_cores())
    yield from directory_cluster(shared_ray, ClusterConfig(port=free_service_port(), **layout), _RUNNING)


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)
