"""The gateway's connections under head and body deadlines and a cap
(pdcluster/services/gateway/http_protocol.py), on the real uvicorn server
(GatewayHTTPServer) over loopback: a connection that sends nothing is closed,
one that sends its head a piece at a time gets 408; a body still coming at
its deadline gets 408 and the app reading it (the gateway's own read_body) hears the client
leave; past the cap a new connection is closed as it opens; requests on the
connections kept are answered, and an idle kept-alive connection has no head
or body deadline running.  Each close is awaited
(EOF on the client's socket) with a bound far past the deadline, and what
must stay open is checked on the server's state, so the verdicts do not
depend on the machine's speed."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from starlette.requests import Request

from pdcluster.services.gateway import http_protocol
from pdcluster.services.gateway.http import GatewayHTTPServer
from pdcluster.services.gateway.http_protocol import MIN_CONNECTIONS, connection_cap, timeout_response
from pdcluster.services.openai.errors import OpenAIError
from pdcluster.services.openai.intake import read_body

HEAD_S = 0.3
WAIT_S = 30.0  # for a close that is due in HEAD_S


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def _body_app(outcomes: list[str]):
    """Reads the body as the gateway's routes do (read_body) and answers its length; ``outcomes``
    gets what reading ended in."""
    async def app(scope, receive, send):
        try:
            body = await read_body(Request(scope, receive), 1 << 20)
        except OpenAIError as exc:
            outcomes.append(exc.message)
            return
        outcomes.append(f"read {len(body)}")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
    return app


def _post(length: int) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % length


async def _closed(reader: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF) within WAIT_S."""
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


async def _ask(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    writer.write(REQUEST)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    return head + await asyncio.wait_for(reader.readexactly(2), WAIT_S)


def _serve(test, with_server: bool = False, app=_app, **bounds):
    async def go():
        server = GatewayHTTPServer(app, "127.0.0.1", 0, **bounds)
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


def test_a_head_sent_a_piece_at_a_time_gets_408_at_its_deadline():
    async def test(connect):
        reader, writer = await connect()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and the rest never comes
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT_S)  # all the server sends, to its end
        assert answer == timeout_response("head", HEAD_S)
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
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


def _late_body_client(port: int, outcomes: list[str]) -> bytes:
    """A blocking client (its socket reads nothing until asked, unlike an asyncio stream): sends a head
    and part of the body, more of the body after the deadline passed, then reads all it gets."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(_post(100) + b'{"prompt": "')
        stop = time.monotonic() + WAIT_S
        while not outcomes and time.monotonic() < stop:  # the deadline passed: the app heard the client leave
            time.sleep(0.01)
        sock.sendall(b"x" * 88)
        time.sleep(HEAD_S)  # a reset, were there one, would be back by now
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_body_still_coming_at_its_deadline_gets_408_and_the_app_hears_the_client_leave(monkeypatch):
    """The client sends more of its body after the deadline and only then reads: it gets the whole 408
    and then the end (the lingering close reads and drops what came late; a close with the client's
    bytes unread would answer with a reset, which on a real network can discard the 408 still in the
    kernel's send queue -- over loopback it cannot, so this test shows the answer, not that need)."""
    monkeypatch.setattr(http_protocol, "LINGER_S", WAIT_S)  # the lingering close outlasts any stall here
    outcomes: list[str] = []

    async def test(connect, server):
        port = server._socket.getsockname()[1]
        answer = await asyncio.get_running_loop().run_in_executor(None, _late_body_client, port, outcomes)
        assert outcomes == ["the client disconnected while sending the request body"]
        assert answer == timeout_response("body", HEAD_S)
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 408 ") and json.loads(body)["error"]["code"] == "request_timeout"
    _serve(test, with_server=True, app=_body_app(outcomes), body_timeout_s=HEAD_S)


def test_a_body_sent_whole_is_read_and_leaves_no_body_deadline_running():
    """Read from the server's connection state with the default 30 s deadline (no verdict depends on
    how fast the machine is)."""
    outcomes: list[str] = []

    async def test(connect, server):
        reader, writer = await connect()
        payload = b'{"prompt": "hi"}'
        writer.write(_post(len(payload)) + payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
        assert head.startswith(b"HTTP/1.1 200") and await asyncio.wait_for(reader.readexactly(2), WAIT_S) == b"ok"
        (conn,) = server._server.server_state.connections
        assert conn._body_deadline is None and conn._head_deadline is None
        assert outcomes == [f"read {len(payload)}"]
        writer.close()
    _serve(test, with_server=True, app=_body_app(outcomes))


def test_a_body_trickled_after_an_early_response_is_cut_at_its_deadline_without_a_second_answer():
    """An app may answer before the body is in (here: without reading it); a client that then keeps
    the body coming is still closed at the deadline, with nothing written after the app's answer."""
    async def test(connect):
        reader, writer = await connect()
        writer.write(_post(100) + b"{")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nok")
    _serve(test, body_timeout_s=HEAD_S)


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
