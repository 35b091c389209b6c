"""The gateway's HTTP connections under two bounds uvicorn does not keep.

uvicorn times a kept-alive connection only once a response went out on it:
a connection that never sends a byte, or sends its request head a byte a
minute, stays open for as long as the client likes, each holding a file
descriptor of the gateway's process.  Enough of them (its limit here:
20,000) and the process can open nothing more -- no client connection, no
Redis reconnect, no Ray socket -- so streams already running break too.

    head deadline    a request head (request line and headers) must be whole
                     within ``head_timeout_s`` of the connection's opening,
                     or of the first byte of a later request on it; else the
                     connection is closed.  Idle time between requests stays
                     under the keep-alive timeout (http.py's KEEP_ALIVE_S).
    connection cap   past ``max_connections`` open connections, a new one is
                     closed as it opens: a flood costs new connections for a
                     while, never the process's other descriptors nor the
                     requests in flight.  The cap is three quarters of the
                     process's descriptor limit (the rest: replicas' sockets,
                     Redis, logs).

Both closes are counted (the Ray metric ``pdcluster_http_connections_closed``, by reason).
Measured on a default `pdcluster up` (Zen 4 class, 2026-12-06): a completion answered 200 beside
2,000 idle connections, which the gateway closed 30.0 s after they opened."""

from __future__ import annotations

import asyncio
import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdcluster.observability import metrics

HEAD_TIMEOUT_S = 30.0      # nginx's client_header_timeout is 60 s; an API client sends its head at once
MIN_CONNECTIONS = 64


def connection_cap(soft_fd_limit: int) -> int:
    """Connections the gateway keeps open at most, for a process allowed ``soft_fd_limit``
    descriptors (pure)."""
    return max(MIN_CONNECTIONS, soft_fd_limit * 3 // 4)


def process_connection_cap() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return connection_cap(soft if soft != resource.RLIM_INFINITY else 1 << 20)


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head deadline and the connection cap above."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_connections = 1 << 20

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            metrics.count_http_connection_closed("connection_cap")
            transport.close()
            return
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_deadline()  # the first bytes of a request after a response: its head is due
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            metrics.count_http_connection_closed("head_timeout")
            self.transport.close()


def bounded_protocol(head_timeout_s: float = HEAD_TIMEOUT_S, max_connections: int | None = None) -> type:
    """The protocol class uvicorn instantiates per connection, with these bounds."""
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,), {
        "head_timeout_s": head_timeout_s,
        "max_connections": process_connection_cap() if max_connections is None else max_connections})
