"""The gateway's own HTTP server (``ingress: gateway``, the default).

Every streamed token used to cross two Serve hops before reaching the
client: Serve's HTTP proxy actor -> the gateway replica (ASGI messages over
Ray) -> the engine replica.  Here the gateway replica serves HTTP itself, on
the cluster's host:port, with uvicorn on the replica's own event loop; Serve
starts no proxy.  ``SO_REUSEPORT`` lets several gateway replicas on one node
share the port (the kernel spreads connections).  ``ingress: serve_proxy``
keeps Serve's proxy in front instead.

In front of the app sits what Serve's proxy would have done for it
(``RequestIdMiddleware`` with ``forward_header``): an ``x-request-id`` on
every request (the client's own when sane), echoed on every response.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from starlette.types import ASGIApp

from pdcluster.services.gateway.http_protocol import BODY_TIMEOUT_S, HEAD_TIMEOUT_S, bounded_protocol
from pdcluster.services.openai.request_id import RequestIdMiddleware

log = logging.getLogger("pdcluster.gateway")


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


# How long an idle kept-alive connection stays open.  uvicorn's 5 s default closed connections that
# clients pool between a chat's turns (a user thinking 15 s): a request sent as the server closed its
# connection failed with "Server disconnected" (seen once in 768 turns of bench.load.prefix_tiers).
# Longer than the 60 s idle timeout of common load balancers, which must close first.
KEEP_ALIVE_S = 75


class GatewayHTTPServer:
    """uvicorn serving ``app`` on ``host:port`` from the running event loop."""

    def __init__(self, app: ASGIApp, host: str, port: int, head_timeout_s: float = HEAD_TIMEOUT_S,
                 max_connections: int | None = None, body_timeout_s: float = BODY_TIMEOUT_S):
        """``head_timeout_s``, ``max_connections``, ``body_timeout_s``: the connections' bounds
        (http_protocol.py; ``max_connections`` None: from the process's descriptor limit)."""
        self.host, self.port = host, port
        self._socket = listening_socket(host, port)
        self._server = uvicorn.Server(uvicorn.Config(
            RequestIdMiddleware(app, forward_header=True), lifespan="off", log_level="warning", access_log=False,
            timeout_graceful_shutdown=30, timeout_keep_alive=KEEP_ALIVE_S,
            http=bounded_protocol(head_timeout_s, max_connections, body_timeout_s)))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.serve())

    async def serve(self) -> None:
        """Serves until ``stop``; an owner that supervises its tasks awaits this instead of ``start``."""
        if self._task is None:
            self._task = asyncio.current_task()
        log.info("gateway serving HTTP on %s:%d", self.host, self.port)
        await self._server.serve(sockets=[self._socket])
        if not self._server.should_exit:
            raise RuntimeError(f"the gateway's HTTP server on {self.host}:{self.port} stopped by itself")

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
