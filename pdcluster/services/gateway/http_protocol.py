"""The gateway's HTTP connections under three bounds uvicorn does not keep.

uvicorn times a kept-alive connection only once a response went out on it:
a connection that never sends a byte, sends its request head a byte a
minute, or sends its head and then its body a byte a minute, stays open for
as long as the client likes, each holding a file descriptor of the gateway's
process (and, past the head, a task of the app waiting for the body).
Enough of them (its limit here: 20,000) and the process can open nothing
more -- no client connection, no Redis reconnect, no Ray socket -- so
streams already running break too.

    head deadline    a request head (request line and headers) must be whole
                     within ``head_timeout_s`` of the connection's opening,
                     or of the first byte of a later request on it; else the
                     client gets 408 where part of a head came (a connection
                     that sent nothing gets no answer) and the connection is
                     closed.  Idle time between requests stays under the
                     keep-alive timeout (http.py's KEEP_ALIVE_S).
    body deadline    a request's body must be whole within ``body_timeout_s``
                     of its head (the default body limit, 1 MiB, takes 8 s at
                     1 Mbit/s); else the client gets 408 (or, once a response
                     started, nothing more) and the connection is closed: the
                     app sees the client disconnect and its request ends.
    connection cap   past ``max_connections`` open connections, a new one is
                     closed as it opens: a flood costs new connections for a
                     while, never the process's other descriptors nor the
                     requests in flight.  The cap is three quarters of the
                     process's descriptor limit (the rest: replicas' sockets,
                     Redis, logs).

A 408 has an OpenAI-style body (code ``request_timeout``) and ends in a
lingering close: LINGER_S of the client's late bytes read and dropped, so
the close does not reset the connection before the client reads the answer.
Each close is counted (the Ray metric ``pdcluster_http_connections_closed``,
by reason).  Measured on a default `pdcluster up` (Zen 4 class, 2026-12-06):
a completion answered 200 beside 2,000 idle connections, which the gateway
closed 30.0 s after they opened; a body sent a byte a second got its 408 at
30.0 s."""

from __future__ import annotations

import asyncio
import json
import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from pdcluster.observability import metrics

HEAD_TIMEOUT_S = 30.0      # nginx's client_header_timeout is 60 s; an API client sends its head at once
BODY_TIMEOUT_S = 30.0      # nginx's client_body_timeout (60 s) is between two reads; this is the whole body
LINGER_S = 2.0             # after a 408, how long the client's late bytes are read and dropped before the close
MIN_CONNECTIONS = 64


def connection_cap(soft_fd_limit: int) -> int:
    """Connections the gateway keeps open at most, for a process allowed ``soft_fd_limit``
    descriptors (pure)."""
    return max(MIN_CONNECTIONS, soft_fd_limit * 3 // 4)


def process_connection_cap() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return connection_cap(soft if soft != resource.RLIM_INFINITY else 1 << 20)


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head and body deadlines and the connection cap above."""

    head_timeout_s = HEAD_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    max_connections = 1 << 20

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_begun = False  # bytes of the head that is due have come
        self._body_deadline: asyncio.TimerHandle | None = None
        self._lingering: asyncio.TimerHandle | None = None  # after a 408: the close that ends it
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            metrics.count_http_connection_closed("connection_cap")
            transport.close()
            return
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return  # the rest of an overdue head or body: read and dropped
        if self._head_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_deadline()  # the first bytes of a request after a response: its head is due
        if self._head_deadline is not None and data:
            self._head_begun = True
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        super().on_headers_complete()
        self._disarm_body_deadline()  # none runs here (a message completes before the next head); kept safe
        self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_overdue, self.cycle)

    def on_message_complete(self) -> None:
        self._disarm_body_deadline()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        if self._lingering is not None:
            self._lingering.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _disarm_head_deadline(self) -> None:
        self._head_begun = False
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        metrics.count_http_connection_closed("head_timeout")
        if self._head_begun:
            self._answer_and_close(timeout_response("head", self.head_timeout_s))
        else:
            self.transport.close()

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_overdue(self, cycle: RequestResponseCycle) -> None:
        """The body of ``cycle``'s request is still coming ``body_timeout_s`` after its head."""
        self._body_deadline = None
        if self.transport.is_closing():
            return
        metrics.count_http_connection_closed("body_timeout")
        answer = not cycle.response_started
        cycle.disconnected = True  # from now the app's receive() answers http.disconnect, its send() writes nothing
        cycle.message_event.set()
        if answer:
            self._answer_and_close(timeout_response("body", self.body_timeout_s))
        else:
            self.transport.close()

    def _answer_and_close(self, response: bytes) -> None:
        """A lingering close: the client may still be sending, and a close with its bytes unread would
        reset the connection, which can discard the answer before the client reads it.  So: the answer,
        then our side's end, then what still comes is read and dropped for LINGER_S before the close."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write(response)
        self.transport.write_eof()
        self._lingering = self.loop.call_later(LINGER_S, self.transport.close)
        self.flow.resume_reading()


def timeout_response(part: str, timeout_s: float) -> bytes:
    """The 408 a client gets whose request ``part`` ("head": request line and headers, from the first
    byte of the request or of the connection; "body": from the head) was not whole in ``timeout_s`` (pure)."""
    body = json.dumps({"error": {
        "message": f"the request {part} did not arrive whole within {timeout_s:g} s; send it at once "
                   "(the gateway closes the connection)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


def bounded_protocol(head_timeout_s: float = HEAD_TIMEOUT_S, max_connections: int | None = None,
                     body_timeout_s: float = BODY_TIMEOUT_S) -> type:
    """The protocol class uvicorn instantiates per connection, with these bounds."""
    return type("BoundedHttpProtocol", (BoundedHttpProtocol,), {
        "head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s,
        "max_connections": process_connection_cap() if max_connections is None else max_connections})
