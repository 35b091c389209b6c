"""Spans, context propagation, exceptions and the no-text rule."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from span_helpers import finished_spans
from opentelemetry import trace

from pdcluster.observability import tracing
from pdcluster.observability.tracing import drop_text, inject, is_text_attribute, span


def test_setup_is_idempotent_and_writes_one_line_per_span(span_file: Path) -> None:
    assert tracing.setup_tracing("svc-a", jsonl_path=span_file)
    assert tracing.setup_tracing("svc-b", jsonl_path=span_file)  # ignored: already set up
    with span("once"):
        pass
    spans = finished_spans(span_file)
    assert list(spans) == ["once"]
    assert spans["once"]["service"] == "svc-a" and spans["once"]["pid"] > 0
    assert spans["once"]["end_ns"] >= spans["once"]["start_ns"] > 0


def test_inject_extract_round_trip_keeps_trace_and_parent(span_file: Path) -> None:
    tracing.setup_tracing("svc", jsonl_path=span_file)
    with span("gateway.request") as root:
        carrier = inject()
        assert carrier["traceparent"].split("-")[1] == tracing.trace_id_hex(root)
    # Another "process": nothing current, only the carrier.
    assert tracing.trace_id_hex() is None
    ctx = tracing.extract(carrier)
    assert trace.get_current_span(ctx).get_span_context().trace_id == root.get_span_context().trace_id
    with span("prefill.compute", carrier, {"prompt.tokens": 12}):
        with span("nested"):
            pass
    tracing.record_span("prefill.queue", time.time_ns() - 5_000_000, time.time_ns(), carrier)
    spans = finished_spans(span_file)
    root_d = spans["gateway.request"]
    for name in ("prefill.compute", "prefill.queue"):
        assert spans[name]["trace_id"] == root_d["trace_id"]
        assert spans[name]["parent_span_id"] == root_d["span_id"]
    assert spans["nested"]["parent_span_id"] == spans["prefill.compute"]["span_id"]
    assert spans["prefill.compute"]["attributes"] == {"prompt.tokens": 12}
    assert 4e6 <= spans["prefill.queue"]["end_ns"] - spans["prefill.queue"]["start_ns"] <= 6e6


def test_incoming_traceparent_continues_the_callers_trace(span_file: Path) -> None:
    tracing.setup_tracing("svc", jsonl_path=span_file)
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    root = tracing.start_span("gateway.request", {"traceparent": f"00-{caller_trace}-{caller_span}-01"})
    assert tracing.trace_id_hex(root) == caller_trace
    tracing.end_span(root)
    with span("outer"):
        with span("inner", {}):  # an empty carrier keeps the current parent, no new trace
            pass
    spans = finished_spans(span_file)
    assert spans["gateway.request"]["parent_span_id"] == caller_span
    assert spans["inner"]["parent_span_id"] == spans["outer"]["span_id"]


def test_span_records_exceptions_and_cancellation(span_file: Path) -> None:
    tracing.setup_tracing("svc", jsonl_path=span_file)
    with pytest.raises(ValueError):
        with span("boom"):
            raise ValueError("no free KV blocks")

    async def cancelled() -> None:
        with span("left"):
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    spans = finished_spans(span_file)
    boom = spans["boom"]
    assert boom["status"] == "ERROR" and "no free KV blocks" in boom["status_message"]
    assert boom["attributes"]["error.type"] == "ValueError"
    assert [e["name"] for e in boom["events"]] == ["exception"]
    assert boom["events"][0]["attributes"]["exception.type"] == "ValueError"
    assert spans["left"]["status"] == "UNSET" and spans["left"]["attributes"]["cancelled"] is True


def test_decorator_sync_and_async(span_file: Path) -> None:
    tracing.setup_tracing("svc", jsonl_path=span_file)

    @span("deco.async", pool="prefill")
    async def work() -> str | None:
        await asyncio.sleep(0)
        return tracing.trace_id_hex()

    @span("deco.sync")
    def sync_work(x: int) -> int:
        tracing.set_attrs({"x": x})
        return x + 1

    assert asyncio.run(work()) is not None
    assert sync_work(1) == 2
    spans = finished_spans(span_file)
    assert spans["deco.async"]["attributes"] == {"pool": "prefill"}
    assert spans["deco.sync"]["attributes"] == {"x": 1}


TEXT = {"prompt": "my secret prompt", "prompt.text": "my secret prompt", "completion": "secret answer",
        "gen_ai.prompt.0.content": "my secret prompt", "llm.messages": "hi", "prompt.tokens": 5,
        "output.tokens": 3, "finish_reason": "stop"}


def test_text_attributes_dropped_unless_enabled(span_file: Path) -> None:
    assert [k for k in TEXT if not is_text_attribute(k)] == ["prompt.tokens", "output.tokens", "finish_reason"]
    tracing.setup_tracing("svc", jsonl_path=span_file)
    with span("req", None, TEXT):
        tracing.set_attrs(TEXT, text_delta="more secret")
    tracing.record_span("later", time.time_ns(), time.time_ns(), None, TEXT)
    spans = finished_spans(span_file)
    for name in ("req", "later"):
        assert set(spans[name]["attributes"]) == {"prompt.tokens", "output.tokens", "finish_reason"}
    assert "secret" not in span_file.read_text()


def test_text_attributes_kept_when_enabled(span_file: Path) -> None:
    tracing.setup_tracing("svc", jsonl_path=span_file, record_text=True)
    with span("req", None, TEXT):
        pass
    assert finished_spans(span_file)["req"]["attributes"]["prompt"] == "my secret prompt"
    assert drop_text({"prompt": "x", "n": None}, record_text=False) == {}


def test_disabled_tracing_costs_nothing_and_writes_nothing(span_file: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.setup_tracing("svc", jsonl_path=span_file)
    with span("ignored") as s:
        assert not s.is_recording()
        assert inject() == {}
    assert not span_file.exists()


def test_mono_to_ns_maps_the_engine_clock() -> None:
    before = time.time_ns()
    assert abs(tracing.mono_to_ns(time.monotonic()) - before) < 50_000_000
    assert tracing.mono_to_ns(time.monotonic() - 1.0) < before - 900_000_000


def test_carrier_of_finds_the_message_argument() -> None:
    class Msg:
        trace_context = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert tracing.carrier_of((Msg(),)) == Msg.trace_context
    assert tracing.carrier_of(()) is None
    assert tracing.carrier_of(("a prompt",)) is None
