"""One real cluster for the failover tests: 1 prefill + 2 decode replicas,
fault injection on, ``fallback_to_colocated`` (a stream whose last decode
replica died resumes on the prefill replica), no SLO shedding (8 streams
start at once), and the default dtype, bf16: a resumed stream recomputes its
prompt through the prefill kernel and the tokens already sent as decode rows
(pdcluster/services/engine/runner.py), so each position gets the K/V and logits of the
original steps bit for bit and greedy output cannot flip on a near-tie
(tests/integration/engine/test_engine_resume_bf16.py shows it on the engine).

A resumed stream with more than RESUME_LOCAL_MAX_TOKENS tokens to prefill
again goes through the prefill pool; every other test here stays below it
(prompts of a few tokens, at most 200 generated), so they recompute on the
new replica.  Spans go to one file per session (``trace_file``).

Tests here SIGKILL replicas; each leaves both decode replicas serving
(``wait_decode_replicas``) before it ends."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig, RouterSettings
from tests.integration.cluster.conftest import board, directory_cluster, small_pool, stop_after_directory
from tests.integration.faults.conftest import wait_serving

INTER_TOKEN_TIMEOUT_S = 30.0
RESUME_LOCAL_MAX_TOKENS = 256
_RUNNING: list = []


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("failover-traces") / "spans.jsonl"


@pytest.fixture(scope="session")
def failover_cluster(shared_ray, trace_file):
    config = ClusterConfig(port=free_service_port(), prefill=small_pool(kv_cache_mib=160),
                           fault_injection=True, trace_file=str(trace_file),
                           decode=small_pool(num_replicas=2, kv_cache_mib=160), fallback_to_colocated=True,
                           lease_ttl_s=120.0, router=RouterSettings(resume_local_max_tokens=RESUME_LOCAL_MAX_TOKENS),
                           # The faults act on the hand-off path: every prompt through the prefill pool.
                           admission=AdmissionSettings(shed=False, inter_token_timeout_s=INTER_TOKEN_TIMEOUT_S,
                                                       max_local_prefill_s=0.0))
    yield from directory_cluster(shared_ray, config, _RUNNING)


@pytest.fixture(scope="session")
def failover_url(failover_cluster) -> str:
    return f"http://127.0.0.1:{failover_cluster.config.port}"


def decode_replicas(cluster) -> list[dict]:
    return [s for s in board(cluster) if s["role"] == "decode" and s.get("engine_alive", True)]


def sigkill(status: dict) -> None:
    """Kills a replica's actor process as the kernel's OOM killer would: no cleanup, no goodbye."""
    os.kill(status["pid"], signal.SIGKILL)


def wait_decode_replicas(cluster, url: str, n: int, timeout_s: float = 240.0) -> None:
    """Until ``n`` live decode replicas are on the board (after Serve replaced a
    killed one, or a resize) and the cluster serves a request."""
    deadline = time.monotonic() + timeout_s
    while len({s["name"] for s in decode_replicas(cluster)}) != n or \
            any(time.time() - s["time"] > 2.0 for s in decode_replicas(cluster)):
        assert time.monotonic() < deadline, f"not {n} decode replicas: {decode_replicas(cluster)}"
        time.sleep(0.5)
    wait_serving(url, timeout_s=timeout_s)
