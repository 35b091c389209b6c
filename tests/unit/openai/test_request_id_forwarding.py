"""``RequestIdMiddleware(forward_header=True)`` in front of the app -- what
the gateway's own HTTP server runs, standing in for Serve's proxy: the app
behind it sees the same id it echoes, exactly once, whether the client sent
a sane one, an unusable one or none."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pdcluster.services.openai.request_id import RequestIdMiddleware


def inner_app():
    async def seen(request: Request) -> JSONResponse:
        return JSONResponse({"state": request.state.request_id, "header": request.headers.get("x-request-id")})

    app = Starlette(routes=[Route("/", seen)])
    app.add_middleware(RequestIdMiddleware, echo_header=False)  # as the gateway app is built
    return app


@pytest.mark.parametrize("sent", [None, "client-id-7", "bad id with spaces"])
async def test_the_app_sees_the_id_that_is_echoed_once(sent):
    front = RequestIdMiddleware(inner_app(), forward_header=True)
    headers = {} if sent is None else {"x-request-id": sent}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://t") as client:
        r = await client.get("/", headers=headers)
    echoed = r.headers.get_list("x-request-id")
    assert len(echoed) == 1
    assert r.json() == {"state": echoed[0], "header": echoed[0]}
    if sent == "client-id-7":
        assert echoed == ["client-id-7"]
    else:
        assert echoed[0] != sent
