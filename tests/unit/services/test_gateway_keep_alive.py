"""The gateway's HTTP server keeps an idle connection open longer than a
chat user thinks between turns and longer than common load balancers' 60 s
idle timeout (pdcluster/services/gateway/http.py): with uvicorn's 5 s, a
pooled connection reused as the server closed it failed the request."""

from __future__ import annotations

import asyncio

import httpx

from pdcluster.services.gateway.http import KEEP_ALIVE_S, GatewayHTTPServer


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_the_server_keeps_idle_connections_past_a_load_balancers_idle_timeout():
    assert KEEP_ALIVE_S > 60

    async def go():
        server = GatewayHTTPServer(_app, "127.0.0.1", 0)
        assert server._server.config.timeout_keep_alive == KEEP_ALIVE_S
        server.start()
        port = server._socket.getsockname()[1]
        try:
            async with httpx.AsyncClient() as http:  # the socket listens from construction: no wait
                r = await http.get(f"http://127.0.0.1:{port}/")
                assert r.status_code == 200 and r.text == "ok"
                again = await http.get(f"http://127.0.0.1:{port}/")  # the same kept-alive connection
                assert again.status_code == 200
        finally:
            await server.stop()

    asyncio.run(go())
