"""Deadlines, on a real cluster: a stream whose decode stalls gets an error
event at the inter-token deadline, then [DONE], and every stage lets go of
its blocks; a stream whose hand-off waits in line for the decode replica's
KV longer than that deadline is no stalled stream: it finishes whole."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.integration.faults.conftest import INTER_TOKEN_TIMEOUT_S, MODEL, ok_request, wait_no_leaks

pytestmark = pytest.mark.integration
STALL_S = 6.0


def _stream(url: str, body: dict, fault: str) -> tuple[list[dict], list[float]]:
    """The SSE events of a streamed completion (but [DONE]), and when each came."""
    events, times = [], []
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body, headers={"x-pdcluster-fault": fault}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return events, times
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    times.append(time.monotonic())
    raise AssertionError(f"no [DONE] after {events}")


def _inter_token_deadlines(url: str) -> float:
    """The gateway's count of attempts that passed the inter-token deadline (each one a failover)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('pdcluster_failovers_total{reason="inter_token_deadline"}'))


def test_a_hand_off_that_waits_for_kv_past_the_inter_token_deadline_finishes_whole(url, faults_cluster):
    """The decode replica's reservation waits (as in line for a full pool) 1.5 s longer than the
    inter-token deadline: it streams keep-alives meanwhile, which the gateway takes as life and
    never sends on, so the stream ends whole and equal to an unhindered one."""
    body = {"model": MODEL, "prompt": "List the planets of the solar system:", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True, "stream": True}
    plain, _ = _stream(url, body, "")
    before = _inter_token_deadlines(url)
    waited, times = _stream(url, body, f"wait_for_kv:{INTER_TOKEN_TIMEOUT_S + 1.5}")
    # Not even once: a stream resumed elsewhere would end whole too, and hide a deadline that fired.
    assert _inter_token_deadlines(url) == before
    assert not [e for e in waited if "error" in e], waited
    assert [e["choices"][0]["text"] for e in waited] == [e["choices"][0]["text"] for e in plain]
    assert all(e["choices"][0]["text"] for e in waited[:-1])  # no empty keep-alive reached the client
    assert times[1] - times[0] >= INTER_TOKEN_TIMEOUT_S  # the first token (prefill's), then the wait
    wait_no_leaks(faults_cluster, timeout_s=10.0)


def test_a_stalled_stream_ends_with_an_error_event_at_the_inter_token_deadline(url, faults_cluster):
    body = {"model": MODEL, "prompt": "List the planets of the solar system:", "max_tokens": 64,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events, last_token_s, error_s = [], None, None
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"x-pdcluster-fault": f"stall_decode:{STALL_S}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line == "data: [DONE]":
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    error_s = time.monotonic()
                    assert data["error"]["code"] == "deadline_exceeded", data
                else:
                    last_token_s = time.monotonic()
    assert events[-1] == "[DONE]" and error_s is not None and last_token_s is not None, events
    gap = error_s - last_token_s
    assert INTER_TOKEN_TIMEOUT_S - 0.3 <= gap <= INTER_TOKEN_TIMEOUT_S + 1.5, gap
    # The stalled replica lets go once its loop moves again; the prefill side at once.
    wait_no_leaks(faults_cluster, timeout_s=STALL_S + 2.0)
    ok_request(url)
