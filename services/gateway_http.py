"""The gateway's own HTTP server (``ingress: gateway``, the default).

Every streamed token used to cross two Serve hops before reaching the
client: Serve's HTTP proxy actor -> the gateway replica (ASGI messages over
Ray) -> the engine replica.  Here the gateway replica serves HTTP itself, on
the cluster's host:port, with uvicorn on the replica's own event loop; Serve
starts no proxy.  ``SO_REUSEPORT`` lets several gateway replicas on one node
share the port (the kernel spreads connections).  ``ingress: serve_proxy``
keeps Serve's proxy in front instead.

In front of the app sits what Serve's proxy would have done for it: an
``x-request-id`` on every request (the client's own when sane) and echoed on
every response.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.openai.errors import REQUEST_ID_HEADER
from services.openai.request_id import pick_request_id

log = logging.getLogger("pdcluster.gateway")


class ProxyRequestId:
    """Sets ``x-request-id`` on the request (kept when the client's is sane,
    else a fresh one) and echoes it on the response, as Serve's proxy does."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id, _ = pick_request_id(incoming)
        if request_id != incoming:
            headers = MutableHeaders(scope=scope)
            del headers[REQUEST_ID_HEADER]
            headers.append(REQUEST_ID_HEADER, request_id)

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_request_id)


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket that other replicas on this node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"the gateway cannot listen on {host}:{port} ({exc.strerror}): "
                           "stop what holds the port or choose another (`--port`, config `port`)") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class GatewayHTTPServer:
    """uvicorn serving ``app`` on ``host:port`` from the running event loop."""

    def __init__(self, app: ASGIApp, host: str, port: int):
        self.host, self.port = host, port
        self._socket = listening_socket(host, port)
        self._server = uvicorn.Server(uvicorn.Config(
            ProxyRequestId(app), lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=30))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        log.info("gateway serving HTTP on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish (up to 30 s)."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout=35)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self._task.cancel()
        self._task = None
        self._socket.close()
