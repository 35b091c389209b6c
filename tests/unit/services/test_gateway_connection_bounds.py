"""The gateway's connections under a head deadline and a cap
(pdcluster/services/gateway/http_protocol.py), on the real uvicorn server
(GatewayHTTPServer) over loopback: a connection that sends nothing, or its
head a piece at a time, is closed; past the cap a new connection is closed
as it opens; requests on the connections kept are answered, and an idle
kept-alive connection has no head deadline running.  Each close is awaited
(EOF on the client's socket) with a bound far past the deadline, and what
must stay open is checked on the server's state, so the verdicts do not
depend on the machine's speed."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.services.gateway.http import GatewayHTTPServer
from pdcluster.services.gateway.http_protocol import MIN_CONNECTIONS, connection_cap

HEAD_S = 0.3
WAIT_S = 30.0  # for a close that is due in HEAD_S


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def _closed(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF) within WAIT_S."""
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    return head + await asyncio.wait_for(reader.readexactly(2), WAIT_S)


def _serve(test, with_server: bool = False, **bounds):
    async def go():
        server = GatewayHTTPServer(_app, "127.0.0.1", 0, **bounds)
        server.start()
        port = server._socket.getsockname()[1]
        try:
            connect = lambda: asyncio.open_connection("127.0.0.1", port)  # noqa: E731
            await (test(connect, server) if with_server else test(connect))
        finally:
            await server.stop()
    asyncio.run(go())


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline():
    async def test(connect):
        reader, _ = await connect()
        assert await _closed(reader)
    _serve(test, head_timeout_s=HEAD_S)


def test_a_head_sent_a_piece_at_a_time_is_closed_at_its_deadline():
    async def test(connect):
        reader, writer = await connect()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and the rest never comes
        await writer.drain()
        assert await _closed(reader)
    _serve(test, head_timeout_s=HEAD_S)


def test_a_kept_alive_connection_has_no_head_deadline_while_idle_and_one_for_its_next_head():
    """Between requests only the keep-alive timeout (75 s) runs; the next request's first bytes start
    its head deadline, and the whole head stops it.  Read from the server's connection state (the
    default 30 s deadline, so no verdict here depends on how fast the machine is)."""
    async def test(connect, server):
        reader, writer = await connect()
        assert (await _ask(reader, writer)).startswith(b"HTTP/1.1 200")
        (conn,) = server._server.server_state.connections
        assert conn._head_deadline is None and conn.timeout_keep_alive_task is not None
        writer.write(REQUEST[:10])
        await writer.drain()
        async def armed():
            while conn._head_deadline is None:  # until the server has read the first bytes
                await asyncio.sleep(0.01)
        await asyncio.wait_for(armed(), WAIT_S)
        writer.write(REQUEST[10:])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200") and await asyncio.wait_for(reader.readexactly(2), WAIT_S) == b"ok"
        assert conn._head_deadline is None
        writer.close()
    _serve(test, with_server=True)


def test_past_the_cap_a_new_connection_is_closed_and_the_others_are_served():
    async def test(connect):
        kept = [await connect() for _ in range(2)]
        for reader, writer in kept:  # each answered once: both are open on the server's side
            assert (await _ask(reader, writer)).endswith(b"ok")
        extra, _ = await connect()
        assert await _closed(extra)
        for reader, writer in kept:
            assert (await _ask(reader, writer)).endswith(b"ok")
            writer.close()
    _serve(test, max_connections=2)


@pytest.mark.parametrize("limit, cap", [(20000, 15000), (1024, 768), (10, MIN_CONNECTIONS)])
def test_the_cap_leaves_a_quarter_of_the_descriptors(limit, cap):
    assert connection_cap(limit) == cap
