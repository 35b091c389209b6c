"""The ``gateway.request`` root span and HTTP status metrics around every
request, as pure ASGI middleware (streaming bodies and disconnects pass
untouched, and the span ends only after the last SSE byte).

    incoming traceparent ──> gateway.request (continues the caller's trace)
                              current for the route handler, so it can
                              set_attrs() and inject() into GenerateRequest
    response             <── x-trace-id: <32 hex>

Errors raised mid-stream after the 200 went out still count as 2xx here: the
status class is what the client saw on the status line."""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.observability import metrics, tracing
_PROPAGATED_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})
_UNTRACED_PATHS = frozenset({"/health", "/live", "/ready", "/-/healthz", "/-/routes", "/metrics"})  # probes, scrapes


def _carrier(scope: Scope) -> dict[str, str]:
    carrier = {}
    for raw_key, raw_value in scope.get("headers") or ():
        key = raw_key.decode("latin-1").lower()
        if key in _PROPAGATED_HEADERS:
            carrier[key] = raw_value.decode("latin-1")
    return carrier


class TracingMiddleware:
    """Install with ``app.add_middleware(TracingMiddleware)``."""

    def __init__(self, app: ASGIApp, span_name: str = "gateway.request"):
        self.app, self.span_name = app, span_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in _UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        root = tracing.start_span(self.span_name, _carrier(scope), {
            "http.request.method": scope.get("method"), "url.path": scope.get("path")},
            kind=trace.SpanKind.SERVER)
        trace_id = tracing.trace_id_hex(root)
        status: dict[str, Any] = {}

        async def send_with_trace_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                if trace_id is not None:
                    message.setdefault("headers", [])
                    message["headers"] = [*message["headers"],
                                          (tracing.TRACE_ID_HEADER.encode(), trace_id.encode())]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(root))
        error: BaseException | None = None
        try:
            await self.app(scope, receive, send_with_trace_id)
        except BaseException as exc:
            error = exc
            raise
        finally:
            otel_context.detach(token)
            self._finish(root, scope, status.get("code"), error)

    @staticmethod
    def _finish(root: trace.Span, scope: Scope, code: int | None, error: BaseException | None) -> None:
        if code is None and isinstance(error, Exception):
            code = 500  # Starlette's outer error handler answers it
        state = scope.get("state") or {}
        tracing.set_attrs({"http.response.status_code": code, tracing.REQUEST_ID: state.get("request_id")},
                            span=root)
        if code is not None:
            metrics.count_http_response(code)
            if code >= 500 and error is None:
                root.set_status(trace.Status(trace.StatusCode.ERROR, f"HTTP {code}"))
        tracing.end_span(root, error)
