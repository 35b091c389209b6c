"""One trace per request across gateway, prefill and decode processes;
metrics on Ray's Prometheus endpoint; the `pdcluster trace` waterfall."""

from __future__ import annotations

import argparse
import io
import json
import time
from contextlib import redirect_stdout

import httpx
import pytest

from pdcluster.observability.exporters import read_spans
from tests.integration.cluster.conftest import METRICS_REPORT_INTERVAL_S
from tests.integration.cluster.test_cluster_api import MODEL

pytestmark = pytest.mark.integration
STAGES = ["gateway.request", "router.route", "prefill.queue", "prefill.compute", "kv.transfer",
          "decode.queue", "decode.generate"]
SECRET = "zebra-quasar-lighthouse"


def _trace_spans(trace_file, trace_id: str, timeout_s: float = 10.0, expected=frozenset(STAGES)) -> list[dict]:
    """The trace's spans once ``expected`` are all in the file (each process writes its own
    as its spans end), or what is there after ``timeout_s`` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in read_spans(trace_file)[0] if s["trace_id"] == trace_id] if trace_file.exists() else []
        names = {s["name"] for s in spans}
        if set(expected) <= names or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_request_is_one_trace_with_every_stage(cluster, base_url, trace_file):
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say {SECRET} twice."}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http, http.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        trace_id = r.headers["x-trace-id"]
        list(r.iter_lines())
    spans = _trace_spans(trace_file, trace_id)
    by_name = {}
    for s in spans:
        by_name.setdefault(s["name"], s)
    assert set(STAGES) <= set(by_name), sorted(by_name)
    by_id = {s["span_id"]: s for s in spans}
    root = by_name["gateway.request"]
    assert root["parent_span_id"] is None or root["parent_span_id"] not in by_id
    for s in spans:
        if s is root:
            continue
        parent = by_id.get(s["parent_span_id"])
        assert parent is not None, f"{s['name']} has no parent in the trace"
        assert parent["start_ns"] <= s["start_ns"] and s["end_ns"] <= parent["end_ns"] + 2_000_000, s["name"]
    assert len({s["pid"] for s in spans}) >= 3  # gateway, prefill and decode processes
    transfer = by_name["kv.transfer"]["attributes"]
    assert any("bytes" in k for k in transfer) and any("blocks" in k for k in transfer)
    assert any("token" in k for k in by_name["prefill.compute"]["attributes"])
    assert SECRET not in json.dumps(spans)


def test_pdcluster_trace_last_prints_a_waterfall_within_e2e(cluster, base_url, trace_file):
    from pdcluster.services.cli import trace as cli_trace
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 6},
                   timeout=120)
    assert r.status_code == 200
    _trace_spans(trace_file, r.headers["x-trace-id"])
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli_trace.run(argparse.Namespace(last=True, request_id=None, trace_id=None,
                                              file=str(trace_file), list=None, all_attributes=False))
    text = out.getvalue()
    assert rc == 0
    for stage in STAGES:
        assert stage in text, text
    last = text.strip().splitlines()[-1]
    stages_ms, e2e_ms = (float(x) for x in last.split("stages ")[1].split(" ms of E2E ")[0:1] +
                         [last.split(" ms of E2E ")[1].split(" ms")[0]])
    assert 0 < stages_ms <= e2e_ms * 1.01, last


def _counter(text: str, name: str, label: str) -> float:
    rows = [ln for ln in text.splitlines() if ln.startswith(name) and label in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)


def test_metrics_reach_the_prometheus_endpoint(cluster, base_url):
    url = f"http://127.0.0.1:{cluster.metrics_port}/metrics"
    wanted = ["pdcluster_ttft", "pdcluster_tpot", "pdcluster_e2e", "pdcluster_kv_blocks",
              "pdcluster_http_responses", "pdcluster_kv_transfer_bytes", "pdcluster_router_decisions",
              "pdcluster_prefix_cache_hit_tokens", "pdcluster_queue_seconds", "pdcluster_requests_running"]
    ok_name = "ray_pdcluster_http_responses_total"

    def scrape(until, timeout_s=40.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            text = httpx.get(url, timeout=10).text
            if until(text) or time.monotonic() > deadline:
                return text
            time.sleep(1)

    def settled() -> str:
        """The endpoint once the 2xx count has held still across 3 export
        intervals (Ray exports each process's metrics every interval, so
        counts of earlier requests arrive late)."""
        last, deadline = -1.0, time.monotonic() + 90
        while True:
            text = scrape(lambda t: ok_name in t)
            now = _counter(text, ok_name, '"2xx"')
            if now == last or time.monotonic() > deadline:
                return text
            last = now
            time.sleep(3 * METRICS_REPORT_INTERVAL_S)

    before = _counter(settled(), ok_name, '"2xx"')
    n = 3
    shared = "A shared preamble that spans several KV blocks of sixteen tokens each. " * 6
    for i in range(n):  # the same long prefix: later requests hit the prefix cache
        assert httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": f"{shared} Number {i}",
                                                             "max_tokens": 4}, timeout=120).status_code == 200
    scrape(lambda t: _counter(t, ok_name, '"2xx"') >= before + n and all(m in t for m in wanted))
    text = settled()
    assert not [m for m in wanted if m not in text]
    assert _counter(text, ok_name, '"2xx"') == before + n  # exactly the requests sent
