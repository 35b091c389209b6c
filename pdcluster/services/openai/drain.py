"""Stopping without dropping a stream (Kubernetes' SIGTERM, `pdcluster up`'s
Ctrl-C or SIGTERM): the gateway drains before anything stops.

    serving ──start()──> draining ──in flight reaches 0, or the timeout──> stopped by the caller
                         /ready answers 503 {"status": "draining"}: load balancers stop sending here
                         a new request answers 503 + Retry-After (another replica, or after the restart)
                         requests already in flight, streams included, run to their end

``DrainGate`` (pure ASGI middleware) counts the requests in flight from
their first byte to their last, and turns new ones away once draining.
Probes, /metrics and the OpenAPI document stay open throughout."""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Receive, Scope, Send

UNGATED_PATHS = frozenset({"/live", "/ready", "/health", "/metrics", "/openapi.json"})
RETRY_AFTER_S = 5


class Drain:
    """One app's drain state: a flag and the requests in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> dict:
        """Starts draining and waits until nothing is in flight, at most
        ``timeout_s``; says whether it got there and how long it took."""
        self.start()
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            pass
        return {"drained": self.in_flight == 0, "in_flight": self.in_flight,
                "waited_s": round(time.monotonic() - started, 3)}


_REFUSAL = json.dumps({"error": {
    "message": "the gateway is shutting down and takes no new requests; retry (another replica serves it)",
    "type": "service_unavailable", "param": None, "code": "draining"}}).encode()


class DrainGate:
    """Counts requests in ``scope["app"].state.drain``; 503 once draining."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        drain: Drain | None = getattr(getattr(scope.get("app"), "state", None), "drain", None)
        if scope["type"] != "http" or drain is None or scope.get("path") in UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        if drain.draining:
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode()),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": _REFUSAL})
            return
        drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            drain.leave()
