"""One real local cluster per session: embedded Redis, Ray on loopback,
Serve with 1 prefill + 1 decode replica of the real model, the gateway on a
free loopback port."""

from __future__ import annotations

import contextlib
import os

import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, PeerFetchSettings, PoolConfig


def small_pool(**kw) -> PoolConfig:
    return PoolConfig(**({"num_cpus": 1, "num_threads": 1, "kv_cache_mib": 96, "max_queue": 8} | kw))


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


_RUNNING: list = []

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


def stop_after_directory(item, nextitem, running: list) -> None:
    """Stops a directory's cluster right after its last test, so Ray is down
    before tests elsewhere start their own (a session fixture would live
    until the very end of the run).  Call from pytest_runtest_teardown."""
    here = item.path.parent
    if running and (nextitem is None or nextitem.path.parent != here):
        running.pop().stop()


def directory_cluster(config: ClusterConfig, running: list, metrics_interval_s: float | None = None):
    """A session fixture's body: the cluster, started, registered in
    ``running`` for stop_after_directory, and stopped however the run ends.
    ``metrics_interval_s``: Ray's metrics export interval, when a test waits on it."""
    from pdcluster.services.cli.cluster_runtime import LocalCluster

    c = LocalCluster(config, num_cpus=8, dashboard=False, metrics_port=free_service_port())
    try:
        with metrics_report_interval(metrics_interval_s) if metrics_interval_s else contextlib.nullcontext():
            c.start(progress=lambda m: print(m, flush=True))
        running.append(c)
        yield c
    finally:
        if c in running:
            running.remove(c)
            c.stop()


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)


@pytest.fixture(scope="session")
def cluster(trace_file):
    # Replicas inherit the driver's environment: all spans land in one file.
    os.environ["PDCLUSTER_TRACE_FILE"] = str(trace_file)
    # No SLO shedding: on a slow CPU (AVX2 only) these feature tests' bursts predict a
    # TTFT above the SLO and would get 429s; shedding has its own tests (faults/test_overload.py).
    # A killed decode replica's respawn (Ray actor + model load) on a loaded CI machine can
    # outlast the default 30 s inter-token deadline the resumed stream waits within; the
    # deadline has its own tests (faults/test_deadlines.py).
    # These tests check the disaggregated path (routing, hand-off spans, logprobs across it): every
    # prompt goes through the prefill pool (max_local_prefill_s 0); placement has its own tests
    # (tests/integration/admission, tests/unit/services/test_placement.py).
    # A 5 s grammar compile limit (CPU seconds), not 10: test_cluster_grammar_isolation.py's over-limit schema
    # holds a compile worker that long; its slow schemas take about 2 s each.
    config = ClusterConfig(port=free_service_port(), prefill=small_pool(num_replicas=2), decode=small_pool(),
                           lease_ttl_s=120.0,  # far above any wait: a stranded lease fails the leak checks
                           grammar_compile_timeout_s=5.0,
                           peer_fetch=PeerFetchSettings(enabled=True, lease_timeout_s=5.0),  # test_cluster_peer_fetch.py
                           admission=AdmissionSettings(shed=False, inter_token_timeout_s=120.0,
                                                       max_local_prefill_s=0.0))
    yield from directory_cluster(config, _RUNNING, metrics_interval_s=METRICS_REPORT_INTERVAL_S)


@pytest.fixture(scope="session")
def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.config.port}"


@pytest.fixture(scope="session")
def client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def board(cluster) -> list[dict]:
    """Every live replica's status (published to Redis every 0.5 s)."""
    from pdcluster.services.pools.status_board import read_board

    return read_board(cluster.config.index_url, cluster.config.cluster_name)


def replica_actor(cluster, role: str, worker_name: str | None = None):
    """A live Serve replica actor of one pool (by its status-board name)."""
    import ray
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX

    names = [s["name"] for s in board(cluster) if s["role"] == role]
    name = worker_name or names[0]
    unique_id = name.split(f"{role}-", 1)[1]
    return ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}pdcluster#{role}#{unique_id}", namespace="serve")
