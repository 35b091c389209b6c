"""Kubernetes' two questions, answered apart (both open without an API key,
untraced, like /health):

    GET /live    liveness: this process serves HTTP.  Always 200 while the
                 event loop runs; a failing pool never restarts the gateway.
    GET /ready   readiness: a request sent now succeeds: the backend's health
                 (every pool the mode needs has a live engine) is ok.  503
                 with the reason otherwise, so a Service stops sending here;
                 503 ``draining`` from the moment a shutdown began (drain.py).

``/health`` keeps its meaning (the backend's health, as /ready) for the
clients and scripts that already poll it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdcluster.services.openai.host import host_of

router = APIRouter()
PATHS = ("/live", "/ready")
_STATUS = {"content": {"application/json": {"schema": {"type": "object"}}}}


@router.get("/live", responses={200: {**_STATUS, "description": "the gateway process serves"}})
async def live() -> JSONResponse:
    return JSONResponse({"status": "alive"})


@router.get("/ready", responses={200: {**_STATUS, "description": "a request sent now succeeds"},
                                 503: {**_STATUS, "description": "not ready, with the reason"}})
async def ready(request: Request) -> JSONResponse:
    drain = getattr(request.app.state, "drain", None)
    if drain is not None and drain.draining:
        return JSONResponse({"status": "draining", "in_flight": drain.in_flight}, status_code=503)
    status: dict[str, Any] = await host_of(request).backend.health()
    return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)
