"""The gateway.request root span around an ASGI app: continues an incoming
traceparent, is current in the handler, returns x-trace-id, ends after a
streamed body, and counts status classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from span_helpers import finished_spans

from pdcluster.observability import metrics, tracing
from pdcluster.services.openai.tracing import TracingMiddleware


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        tracing.set_attrs({tracing.REQUEST_ID: "req-1", "prompt.tokens": 4, "prompt": "secret"})
        return JSONResponse({"carrier": tracing.inject()})

    @app.post("/v1/stream")
    async def stream() -> StreamingResponse:
        async def body():
            for i in range(3):
                with tracing.span("decode.generate"):  # the root is still current while streaming
                    yield f"data: {i}\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/busy")
    async def busy() -> JSONResponse:
        return JSONResponse({"error": "overloaded"}, status_code=429)

    app.add_middleware(TracingMiddleware)
    return app


def test_root_span_continues_caller_and_returns_trace_id(span_file: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[int] = []
    monkeypatch.setattr(metrics, "count_http_response", counted.append)
    tracing.setup_tracing("pdcluster-gateway", jsonl_path=span_file)
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with TestClient(_app()) as client:
        r = client.post("/v1/completions", headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"})
        assert r.status_code == 200 and r.headers[tracing.TRACE_ID_HEADER] == caller_trace
        carrier = r.json()["carrier"]
        s = client.post("/v1/stream")
        assert s.text.count("data:") == 3
        assert client.post("/v1/busy").status_code == 429
    spans, _ = _by_name(span_file)
    roots = spans["gateway.request"]
    first = roots[0]
    assert first["parent_span_id"] == caller_span and first["trace_id"] == caller_trace
    assert carrier["traceparent"] == f"00-{caller_trace}-{first['span_id']}-01"
    assert first["attributes"]["http.response.status_code"] == 200
    assert first["attributes"]["prompt.tokens"] == 4 and "prompt" not in first["attributes"]
    stream_root = roots[1]
    assert s.headers[tracing.TRACE_ID_HEADER] == stream_root["trace_id"] != caller_trace
    for child in spans["decode.generate"]:
        assert child["parent_span_id"] == stream_root["span_id"]
        assert child["end_ns"] <= stream_root["end_ns"]
    assert roots[2]["attributes"]["http.response.status_code"] == 429
    assert counted == [200, 200, 429]


def _by_name(path: Path) -> tuple[dict[str, list[dict]], int]:
    finished_spans(path)  # flush
    from pdcluster.observability.exporters import read_spans
    spans, bad = read_spans(path)
    out: dict[str, list[dict]] = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        out.setdefault(s["name"], []).append(s)
    return out, bad
