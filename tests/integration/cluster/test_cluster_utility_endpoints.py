"""/tokenize, /detokenize, /v1/models/{model_id} and the gateway's /metrics
on the live session cluster (1 gateway, 2 prefill + 1 decode replicas, the
embedded Redis status board)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration
MODEL = "SmolLM2-135M-Instruct"
TEXT = "The quick brown fox jumps over the lazy dog, twice."


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_labels(all_samples: list, name: str, **labels: str) -> list[float]:
    return [s.value for s in all_samples if s.name == name and labels.items() <= s.labels.items()]


def test_tokenize_round_trips_through_detokenize(base_url):
    r = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": TEXT}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] > body["count"]
    r = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": TEXT}
    r = httpx.post(f"{base_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_chat_tokenize_counts_what_chat_completions_bills(base_url, client):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens == r.json()["count"]


def test_retrieve_a_model(base_url, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    r = httpx.get(f"{base_url}/v1/models/no-such-model", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_metrics_show_requests_latency_and_both_pools_kv(base_url, client):
    client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0)
    deadline = time.monotonic() + 10   # the board refreshes every 0.5 s; the gateway caches it 1 s
    while True:
        r = httpx.get(f"{base_url}/metrics", timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        got = samples(r.text)
        pools = {s.labels.get("pool") for s in got if s.name == "pdcluster_kv_blocks_total"}
        if {"prefill", "decode"} <= pools or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {"prefill", "decode"} <= pools, r.text
    for pool in ("prefill", "decode"):
        assert all(v > 0 for v in by_labels(got, "pdcluster_kv_blocks_total", pool=pool))
        assert by_labels(got, "pdcluster_kv_blocks_used", pool=pool)
    assert sum(by_labels(got, "pdcluster_prompt_tokens_total", pool="prefill")) > 0
    assert by_labels(got, "pdcluster_prefix_cache_hit_tokens_total", pool="prefill")
    assert sum(by_labels(got, "pdcluster_http_responses_total", endpoint="/v1/completions", status_class="2xx")) >= 1
    assert by_labels(got, "pdcluster_ttft_seconds_count")[0] >= 1
    assert by_labels(got, "pdcluster_e2e_seconds_count")[0] >= 1
    assert len(by_labels(got, "pdcluster_admission_in_flight")) == 1
