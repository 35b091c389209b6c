"""One trace per request on a colocated cluster (what a bare `pdcluster up` starts on two
cores): the gateway's spans and the replica's stages, queue, prefill and decode, under one root."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.cluster.test_cluster_api import MODEL
from tests.integration.cluster.test_cluster_tracing import _trace_spans

pytestmark = pytest.mark.integration
STAGES = {"gateway.request", "router.route", "prefill.queue", "prefill.compute", "decode.generate"}


def test_one_request_is_one_trace_with_both_phases_on_the_replica(colocated_cluster, colocated_trace_file):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True}
    url = f"http://127.0.0.1:{colocated_cluster.config.port}/v1/completions"
    with httpx.Client(timeout=120) as http, http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        trace_id = r.headers["x-trace-id"]
        list(r.iter_lines())
    # A hang guard, not a speed target: each process's batch exporter writes within a few seconds.
    spans = _trace_spans(colocated_trace_file, trace_id, timeout_s=60.0, expected=STAGES)
    by_name = {s["name"]: s for s in spans}
    assert STAGES <= set(by_name), sorted(by_name)
    root = by_name["gateway.request"]
    for name in ("prefill.queue", "prefill.compute", "decode.generate"):
        s = by_name[name]
        assert s["parent_span_id"] == root["span_id"] and s["pid"] != root["pid"], name
        assert root["start_ns"] <= s["start_ns"] <= s["end_ns"] <= root["end_ns"] + 2_000_000, name
    queue, compute, gen = by_name["prefill.queue"], by_name["prefill.compute"], by_name["decode.generate"]
    assert queue["end_ns"] == compute["start_ns"] and compute["end_ns"] == gen["start_ns"]
    assert compute["attributes"]["prompt.tokens"] > 0
    assert gen["attributes"]["output.tokens"] == 6 and gen["attributes"]["finish_reason"] == "length"
