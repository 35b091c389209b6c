"""vLLM's metric families at the live cluster's /metrics (1 gateway, 2 prefill
+ 1 decode replicas, the Redis status board): each exists with vLLM's type
and labels, and moves under traffic."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.cluster.conftest import board

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
}
CLUSTER = {"model_name": MODEL}
# Counters and histogram counts that every finished request moves, cluster-wide and in the pools.
MOVED = [("vllm:prompt_tokens_total", CLUSTER), ("vllm:generation_tokens_total", CLUSTER),
         ("vllm:prefix_cache_queries_total", CLUSTER), ("vllm:time_to_first_token_seconds_count", CLUSTER),
         ("vllm:inter_token_latency_seconds_count", CLUSTER), ("vllm:e2e_request_latency_seconds_count", CLUSTER),
         ("vllm:request_queue_time_seconds_count", CLUSTER),
         ("vllm:prompt_tokens_total", {**CLUSTER, "pool": "prefill"}),
         ("vllm:request_queue_time_seconds_count", {**CLUSTER, "pool": "prefill"}),
         ("vllm:request_queue_time_seconds_count", {**CLUSTER, "pool": "decode"})]


def scrape(base_url: str) -> dict:
    r = httpx.get(f"{base_url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample(families: dict, name: str, labels: dict) -> float | None:
    """The one sample ``name`` with exactly ``labels``, or None."""
    hits = [s.value for f in families.values() for s in f.samples if s.name == name and s.labels == labels]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else None


def wait_for(base_url: str, ready, timeout_s: float = 60.0) -> dict:
    """Scrapes until ``ready(families)`` (the board refreshes every 0.5 s, the gateway caches it 1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        families = scrape(base_url)
        if ready(families) or time.monotonic() > deadline:
            return families
        time.sleep(0.25)


def both_pools(families: dict) -> bool:
    pools = {s.labels.get("pool") for s in families["vllm:kv_cache_usage_perc"].samples}
    return {None, "prefill", "decode"} <= pools


def test_every_vllm_family_has_vllms_type_and_labels(base_url, client):
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=2, temperature=0)
    families = wait_for(base_url, both_pools)
    assert both_pools(families), sorted(families)
    for name, kind in TYPES.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name].type == kind, name
        got = families[name].samples
        assert got and all(s.labels["model_name"] == MODEL for s in got), name
        assert any("pool" not in s.labels for s in got), f"{name}: no cluster-wide series"
        if name != "vllm:cache_config_info":
            assert set().union(*(s.labels for s in got)) <= {"model_name", "pool", "le"}, name
    assert 0 <= sample(families, "vllm:kv_cache_usage_perc", CLUSTER) <= 1
    info = [s.labels for s in families["vllm:cache_config_info"].samples if "pool" not in s.labels]
    assert info[0]["block_size"] == "16" and int(info[0]["num_gpu_blocks"]) > 0


def test_vllm_families_move_under_traffic(base_url, client):
    before = wait_for(base_url, both_pools)
    seen_running = threading.Event()

    def watch_running():
        def running(families: dict) -> bool:
            value = sample(families, "vllm:num_requests_running", CLUSTER)
            return value is not None and value >= 1
        if running(wait_for(base_url, lambda f: running(f) or done.is_set(), timeout_s=120)):
            seen_running.set()

    done = threading.Event()
    watcher = threading.Thread(target=watch_running, daemon=True)
    watcher.start()
    try:
        for _ in range(3):   # a long stream is in the engines for seconds: the watcher sees it running
            stream = client.completions.create(model=MODEL, prompt="Count slowly: one, two,", max_tokens=96,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True})
            assert sum(len(c.choices[0].text) > 0 for c in stream) > 1
            if seen_running.is_set():
                break
    finally:
        done.set()
        watcher.join(timeout=130)
    assert seen_running.is_set(), "vllm:num_requests_running never rose above 0 during three 96-token streams"

    def moved(families: dict) -> bool:
        return all((sample(families, n, labels) or 0) > (sample(before, n, labels) or 0) for n, labels in MOVED)

    after = wait_for(base_url, moved)
    for name, labels in MOVED:
        assert (sample(after, name, labels) or 0) > (sample(before, name, labels) or 0), (name, labels)
    assert sample(after, "vllm:generation_tokens_total", CLUSTER) >= sample(
        before, "vllm:generation_tokens_total", CLUSTER) + 96


def test_a_decode_replicas_tokens_reach_the_gateway_over_the_token_channel(base_url, client, cluster):
    """The default (token_channel: true): every streamed delta after the prefill replica's first
    token arrives as a frame at the gateway's inbox, none refused or malformed, and no replica fell
    back to Serve's per-token streaming."""
    before = scrape(base_url)
    stream = client.completions.create(model=MODEL, prompt="Name three colours:", max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = [c.choices[0].text for c in stream if c.choices]
    after = scrape(base_url)

    def delta(name: str, outcome: str) -> float:
        labels = {"outcome": outcome}
        return (sample(after, name, labels) or 0) - (sample(before, name, labels) or 0)

    assert len(texts) >= 12
    assert delta("pdcluster_token_channel_frames_total", "delivered") >= 11  # the first token is the prefill's
    assert sample(after, "pdcluster_token_channel_frames_total", {"outcome": "malformed"}) == 0
    assert sample(after, "pdcluster_token_channel_connections_total", {"outcome": "refused"}) == 0
    assert sample(after, "pdcluster_token_channel_connections_total", {"outcome": "accepted"}) >= 1
    assert all(s["token_channel_fallbacks"] == 0 for s in board(cluster))
