"""No live prefill replica, on a real cluster: the prefill pool is scaled to
zero (Serve autoscaling with min_replicas 0), the decode pool has one
replica.  The cluster is ready (a request sent now succeeds: the decode
replica prefills it), the request is served whole on the decode replica,
the decode-side prefill is counted on the Prometheus endpoint, and no KV
block stays held (issue 32: never a 503 while a decode replica lives)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdcluster.prefix_store.redis_server import free_service_port
from pdcluster.services.config import ClusterConfig
from tests.integration.cluster.conftest import board, small_pool
from tests.integration.cluster.test_cluster_api import MODEL, wait_no_leaks

pytestmark = pytest.mark.integration
BODY = {"model": MODEL, "prompt": "The three primary colours are", "max_tokens": 8, "temperature": 0}
COUNTER = "ray_pdcluster_decode_pool_prefills_total"


@pytest.fixture(scope="module")
def cluster(shared_ray):
    config = ClusterConfig(
        port=free_service_port(), decode=small_pool(),
        prefill=small_pool(autoscaling={"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}))
    # Not "serving": without a prefill replica /health rightly stays 503.
    with shared_ray.running(config, wait_until="gateway") as c:
        yield c


def post(cluster) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{cluster.config.port}/v1/completions", json=BODY, timeout=120)


def counted(cluster, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=10).text
    rows = [ln for ln in text.splitlines() if ln.startswith(COUNTER) and f'reason="{reason}"' in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)


def test_served_by_the_decode_pool_counted_without_leaks(cluster):
    deadline = time.monotonic() + 15
    while not (roles := [s["role"] for s in board(cluster)]):
        assert time.monotonic() < deadline, "no replica on the status board"
        time.sleep(0.5)
    assert roles == ["decode"]  # the prefill pool is at zero replicas
    health = httpx.get(f"http://127.0.0.1:{cluster.config.port}/health", timeout=10)
    assert health.status_code == 200, health.text  # ready: the decode replica can serve it whole
    assert health.json()["live_replicas"] == {"decode": 1}
    r = post(cluster)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]

    deadline = time.monotonic() + 60  # Ray exports metrics every METRICS_REPORT_INTERVAL_S
    while counted(cluster, "no_prefill_replica") + counted(cluster, "prefill_pool_at_zero") < 1:
        assert time.monotonic() < deadline, "the decode-side prefill was never counted"
        time.sleep(0.5)
    assert counted(cluster, "short_prompt") == 0

    wait_no_leaks(cluster)
