"""Deadlines, on a real cluster: a stream whose decode stalls gets an error
event at the inter-token deadline, then [DONE], and every stage lets go of
its blocks."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.integration.faults.conftest import INTER_TOKEN_TIMEOUT_S, MODEL, ok_request, wait_no_leaks

pytestmark = pytest.mark.integration
STALL_S = 6.0


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
