"""No request can hurt another, on a real cluster: extreme sampling
parameters and huge stop lists get 200 or 4xx and the next request is
served; an engine loop that dies takes its replica out of /health and
Serve replaces it."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.integration.cluster.conftest import board
from tests.integration.faults.conftest import ok_request, post, wait_no_leaks, wait_serving

pytestmark = pytest.mark.integration
PROMPT = "Write a haiku about the sea."


@pytest.mark.parametrize("extra", [
    {"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 1e-8}, {"temperature": 5e-324},
    {"temperature": 1.0, "top_p": 1e-30}, {"temperature": 1.0, "top_p": 5e-324}, {"temperature": 2.0, "top_k": 1},
    {"stop": [f"stop-{i}" for i in range(500)]},
    {"stop": ["x" * 100_000]},
    {"stop_token_ids": list(range(5000))},
], ids=lambda e: ",".join(f"{k}={str(v)[:12]}" for k, v in e.items()))
@pytest.mark.parametrize("stream", [False, True])
def test_hostile_parameters_fail_alone(url, faults_cluster, extra, stream):
    body = {"prompt": PROMPT, "max_tokens": 8, **extra, "stream": stream}
    r = post(url, body)
    assert r.status_code == 200 or 400 <= r.status_code < 500, r.text
    if r.status_code != 200:
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    elif stream:
        assert "data: [DONE]" in r.text and '"error"' not in r.text
    ok_request(url)  # the next request is served
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    wait_no_leaks(faults_cluster)


def test_a_dead_engine_loop_is_reported_and_replaced(url, faults_cluster):
    before = {s["name"] for s in board(faults_cluster) if s["role"] == "prefill"}
    r = post(url, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}, fault="kill_prefill_engine")
    # Serve's check_health failed and it started a new prefill replica; the old one's status-board
    # entry outlives it by up to its TTL (5 s), so wait for a live replacement, within a bound --
    # before any assertion, so that a failure here leaves the next test a whole cluster.
    deadline = time.monotonic() + 180
    while True:
        after = {s["name"] for s in board(faults_cluster) if s["role"] == "prefill" and s.get("engine_alive")}
        if (after and not (after & before)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # The prefill engine died before a first token: the decode replica prefilled it (issue 32).
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4, r.text  # greedy: no early end of sequence
    assert after and not (after & before), (before, after)
    wait_serving(url)
    ok_request(url)
    wait_no_leaks(faults_cluster)
