"""pdcluster.observability.metrics: a no-op without Ray; with Ray, every call carries
exactly the tag keys its metric declares."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdcluster.observability import metrics
def _call_everything() -> None:
    metrics.observe_ttft("prefill", 0.05)
    metrics.observe_tpot("decode", 0.01)
    metrics.observe_e2e("gateway", 1.5)
    metrics.observe_queue("prefill", 0.002)
    metrics.set_engine_stats("decode", "decode-1", SimpleNamespace(
        num_running=3, num_waiting=1, num_awaiting_kv=1, kv_blocks_total=100, kv_blocks_free=40))
    metrics.count_prompt_tokens("prefill", "prefill-1", 512, 256)
    metrics.count_transfer("nixl", 1 << 20, 0.002)
    metrics.count_route("prefill", "cache_aware", "cache_hit")
    metrics.count_http_response(429)
    metrics.count_index_lookup_failure("prefill", "degraded")
    metrics.count_decode_pool_prefill("no_prefill_replica")
    metrics.count_admission_rejection("slo")
    metrics.count_seat_wait("prefill")
    metrics.count_deadline("inter_token")
    metrics.count_http_connection_closed("head_timeout")
    metrics.count_lease_event("late_notification")
    metrics.count_failover("replica_died")
    metrics.count_task_crash("status_board")


def test_noop_without_ray() -> None:
    metrics._reset_for_tests()
    assert not metrics.ray_active()
    _call_everything()
    timer = metrics.RequestTimer("gateway")
    timer.on_tokens(1)
    timer.finish()
    assert metrics._metrics == {}


class FakeMetric:
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def _check(self, value: float, tags: dict[str, str]) -> None:
        assert tuple(sorted(tags)) == tuple(sorted(metrics.SPECS[self.name].tag_keys)), self.name
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((value, tags))

    observe = inc = set = _check


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    metrics._reset_for_tests()
    monkeypatch.setattr(metrics, "ray_active", lambda: True)
    monkeypatch.setattr(metrics, "_create", FakeMetric)
    yield metrics._metrics
    metrics._reset_for_tests()


def test_every_metric_gets_its_declared_tags(fake_ray: dict[str, Any]) -> None:
    _call_everything()
    assert set(fake_ray) == set(metrics.SPECS)
    assert fake_ray["pdcluster_kv_blocks_used"].calls == [(60.0, {"pool": "decode", "replica": "decode-1"})]
    assert fake_ray["pdcluster_requests_waiting"].calls[0][0] == 2.0
    assert fake_ray["pdcluster_http_responses"].calls == [(1.0, {"status_class": "429"})]
    assert fake_ray["pdcluster_decode_pool_prefills"].calls == [(1.0, {"reason": "no_prefill_replica"})]
    assert fake_ray["pdcluster_admission_rejections"].calls == [(1.0, {"reason": "slo"})]
    assert fake_ray["pdcluster_seat_waits"].calls == [(1.0, {"pool": "prefill"})]
    assert fake_ray["pdcluster_deadlines_exceeded"].calls == [(1.0, {"kind": "inter_token"})]
    assert fake_ray["pdcluster_http_connections_closed"].calls == [(1.0, {"reason": "head_timeout"})]
    assert fake_ray["pdcluster_failovers"].calls == [(1.0, {"reason": "replica_died"})]
    assert fake_ray["pdcluster_task_crashes"].calls == [(1.0, {"task": "status_board"})]


def test_zero_counts_are_skipped_and_failures_never_raise(fake_ray: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    metrics.count_prompt_tokens("prefill", "p", 10, 0)  # Ray's Counter rejects inc(0)
    assert "pdcluster_prefix_cache_hit_tokens" not in fake_ray

    def broken(name: str) -> Any:
        raise RuntimeError("no metrics agent")
    monkeypatch.setattr(metrics, "_create", broken)
    metrics.observe_e2e("gateway", 1.0)  # logged once, not raised


def test_request_timer(fake_ray: dict[str, Any]) -> None:
    now = [10.0]
    timer = metrics.RequestTimer("decode", clock=lambda: now[0])
    for t, n in ((10.2, 1), (10.3, 1), (10.6, 4)):
        now[0] = t
        timer.on_tokens(n)
    now[0] = 10.7
    timer.finish(ttft=False)
    timer.finish()  # once only
    assert timer.ttft_s == pytest.approx(0.2) and timer.tpot_s == pytest.approx(0.4 / 5)
    assert "pdcluster_ttft_seconds" not in fake_ray
    assert fake_ray["pdcluster_tpot_seconds"].calls == [(pytest.approx(0.08), {"pool": "decode"})]
    assert fake_ray["pdcluster_e2e_seconds"].calls == [(pytest.approx(0.7), {"pool": "decode"})]


def test_route_outcome_and_gauge_task_without_ray() -> None:
    assert metrics.route_outcome(False, False, 0) == "no_header"
    assert metrics.route_outcome(True, True, 16) == "cache_hit"
    assert metrics.route_outcome(True, True, 0) == "index_degraded"
    assert metrics.route_outcome(True, False, 0) == "load_only"
    asyncio.run(asyncio.wait_for(metrics.export_gauges_forever("decode", "d", lambda: None), 1.0))  # returns


def test_status_class() -> None:
    assert [metrics.status_class(c) for c in (200, 204, 400, 404, 429, 499, 500, 503)] == \
        ["2xx", "2xx", "4xx", "4xx", "429", "4xx", "5xx", "5xx"]
