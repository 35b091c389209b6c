"""One real cluster for the failure-path tests: 1 prefill + 1 decode replica,
fault injection on (pdcluster/services/pools/faults.py), a lease TTL of 120 s so that no
test can pass because a stranded lease timed out, and a short inter-token
deadline.  Tests here may kill replicas; each leaves the cluster serving
(``wait_serving``) before it ends."""

from __future__ import annotations

import time

import httpx
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import AdmissionSettings, ClusterConfig
from tests.integration.cluster.conftest import board, directory_cluster, small_pool, stop_after_directory

MODEL = "SmolLM2-135M-Instruct"
INTER_TOKEN_TIMEOUT_S = 2.0
TTFT_SLO_S = 2.0
_RUNNING: list = []


def pytest_runtest_teardown(item, nextitem):
    stop_after_directory(item, nextitem, _RUNNING)


@pytest.fixture(scope="session")
def faults_cluster(shared_ray):
    config = ClusterConfig(port=free_service_port(), prefill=small_pool(), decode=small_pool(), lease_ttl_s=120.0,
                           fault_injection=True,
                           # The faults act on the hand-off path: every prompt through the prefill pool.
                           admission=AdmissionSettings(ttft_slo_s=TTFT_SLO_S, max_local_prefill_s=0.0,
                                                       inter_token_timeout_s=INTER_TOKEN_TIMEOUT_S))
    yield from directory_cluster(shared_ray, config, _RUNNING)


@pytest.fixture(scope="session")
def url(faults_cluster) -> str:
    return f"http://127.0.0.1:{faults_cluster.config.port}"


def post(url: str, body: dict, fault: str | None = None, timeout: float = 120) -> httpx.Response:
    headers = {"x-pdcluster-fault": fault} if fault else {}
    return httpx.post(url + "/v1/completions", json={"model": MODEL, **body}, headers=headers, timeout=timeout)


def ok_request(url: str) -> None:
    r = post(url, {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def wait_no_leaks(cluster, timeout_s: float = 2.0, roles=("prefill", "decode")) -> list[dict]:
    """Every live replica of ``roles`` back to free == total KV blocks within
    ``timeout_s`` (the board refreshes every 0.5 s; far below the lease TTL)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = [s for s in board(cluster) if s["role"] in roles]
        if stats and all(s["kv_blocks_free"] == s["kv_blocks_total"] and s["running"] == 0
                         and s["awaiting_kv"] == 0 and s["leased_blocks"] == 0 for s in stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks still held {timeout_s} s after the failure: {stats}")
        time.sleep(0.1)


def wait_hand_off(cluster, timeout_s: float = 180.0) -> None:
    """Until both pools have a replica with a live engine on the board: a test
    of the hand-off path must not start while an earlier test's killed prefill
    replica is being replaced (its prompts would be prefilled on the decode
    pool, issue 32, and the path under test never taken)."""
    deadline = time.monotonic() + timeout_s
    while {s["role"] for s in board(cluster) if s.get("engine_alive")} < {"prefill", "decode"}:
        assert time.monotonic() < deadline, f"no live replica in each pool after {timeout_s} s: {board(cluster)}"
        time.sleep(0.5)


def wait_serving(url: str, timeout_s: float = 180.0) -> None:
    """Until /health is 200 and a real request succeeds (after a replica was replaced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                ok_request(url)
                return
        except (httpx.HTTPError, AssertionError):
            pass
        assert time.monotonic() < deadline, "the cluster did not serve again"
        time.sleep(0.5)
