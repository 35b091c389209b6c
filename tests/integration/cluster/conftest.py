"""One real local cluster per session on the run's shared Ray and Redis
(tests/integration/conftest.py): Serve with 2 prefill + 1 decode replicas of
the real model, the gateway on a free loopback port."""

from __future__ import annotations

import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, PeerFetchSettings, PoolConfig
from tests.integration.conftest import METRICS_REPORT_INTERVAL_S, metrics_report_interval  # noqa: F401 - re-exported


def small_pool(**kw) -> PoolConfig:
    return PoolConfig(**({"num_cpus": 1, "num_threads": 1, "kv_cache_mib": 96, "max_queue": 8} | kw))


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


_RUNNING: list = []


def stop_after_directory(item, nextitem, running: list) -> None:
    """Stops a directory's cluster right after its last test, so its replicas
    are gone before tests elsewhere deploy their own (a session fixture would
    live until the very end of the run).  Call from pytest_runtest_teardown."""
    here = item.path.parent
    if running and (nextitem is None or nextitem.path.parent != here):
        running.pop().stop()


class _Registered:
    """What ``running`` holds for stop_after_directory: stop() releases the cluster once."""

    def __init__(self, shared, cluster) -> None:
        self.shared, self.cluster = shared, cluster

    def stop(self) -> None:
        if self.cluster is not None:
            c, self.cluster = self.cluster, None
            self.shared.release(c)


def directory_cluster(shared, config: ClusterConfig, running: list):
    """A session fixture's body: the cluster, deployed on the run's shared
    Ray (``shared_ray``), registered in ``running`` for stop_after_directory,
    and released however the run ends."""
    c = shared.cluster(config)
    entry = _Registered(shared, c)
    try:
        c.start(progress=lambda m: print(m, flush=True))
        running.append(entry)
        yield c
    finally:
        if entry in running:
            running.remove(entry)
        entry.stop()


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)


@pytest.fixture(scope="session")
def cluster(shared_ray, trace_file):
    # No SLO shedding: on a slow CPU (AVX2 only) these feature tests' bursts predict a
    # TTFT above the SLO and would get 429s; shedding has its own tests (faults/test_overload.py).
    # A killed decode replica's respawn (Ray actor + model load) on a loaded CI machine can
    # outlast the default 30 s inter-token deadline the resumed stream waits within; the
    # deadline has its own tests (faults/test_deadlines.py).
    # These tests check the disaggregated path (routing, hand-off spans, logprobs across it): every
    # prompt goes through the prefill pool (max_local_prefill_s 0); placement has its own tests
    # (tests/integration/admission, tests/unit/services/test_placement.py).
    # A 5 s grammar compile limit (CPU seconds), not 10: test_cluster_grammar_isolation.py's over-limit schema
    # holds a compile worker that long; its slow schemas take about a second each.  One compile worker per
    # replica, not 2: three replicas' cold workers (each imports xgrammar and torch) cost the 2 cores more than
    # the second worker gains (measured: the isolation burst 36.7 s against 38.1 s, the twenty schemas that
    # follow it 5.9 s against 14-18 s); the pool's bound itself has unit tests (test_grammar_compile_pool.py).
    config = ClusterConfig(port=free_service_port(), prefill=small_pool(num_replicas=2), decode=small_pool(),
                           lease_ttl_s=120.0,  # far above any wait: a stranded lease fails the leak checks
                           trace_file=str(trace_file),  # every process's spans in one file
                           grammar_compile_timeout_s=5.0,
                           grammar_compile_workers=1,
                           peer_fetch=PeerFetchSettings(enabled=True, lease_timeout_s=5.0),  # test_cluster_peer_fetch.py
                           admission=AdmissionSettings(shed=False, inter_token_timeout_s=120.0,
                                                       max_local_prefill_s=0.0))
    yield from directory_cluster(shared_ray, config, _RUNNING)


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
