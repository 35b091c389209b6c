"""OTEL_TRACES_EXPORTER=otlp sends spans over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT,
alongside the JSONL file, with text attributes dropped there too."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from span_helpers import finished_spans

from pdcluster.observability import tracing
class _Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, self.headers["Content-Type"], body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_otlp_http_from_env(span_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert tracing.setup_tracing("pdcluster-decode", jsonl_path=span_file)
        with tracing.span("decode.generate", None, {"output.tokens": 7, "completion": "secret"}):
            pass
        assert "decode.generate" in finished_spans(span_file)  # flushes OTLP too
    finally:
        server.shutdown()
    path, content_type, body = _Collector.received[-1]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    resource_spans = request.resource_spans[0]
    service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
    sent = resource_spans.scope_spans[0].spans[0]
    assert service == "pdcluster-decode" and sent.name == "decode.generate"
    assert [a.key for a in sent.attributes] == ["output.tokens"]
