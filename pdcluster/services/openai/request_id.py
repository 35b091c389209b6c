"""``x-request-id`` on every request and response: the client's own id when
it is sane (short, printable, no separators that break logs), else a fresh
one.  Pure ASGI, so streaming responses and disconnects pass untouched."""

from __future__ import annotations

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdcluster.services.openai.errors import REQUEST_ID_HEADER

_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def new_request_id() -> str:
    return uuid.uuid4().hex


def pick_request_id(incoming: str | None) -> tuple[str, bool]:
    """``(request_id, came_from_client)``."""
    if incoming is not None and _SANE_REQUEST_ID.fullmatch(incoming):
        return incoming, True
    return new_request_id(), False


class RequestIdMiddleware:
    """Puts ``request_id`` (and ``request_id_from_client``) in
    ``request.state`` and, unless ``echo_header`` is off (a proxy in front
    already adds it, as Ray Serve's does), the header on the response.
    ``forward_header`` also writes the chosen id into the request's headers,
    as Serve's proxy does, so an app behind this one sees the same id."""

    def __init__(self, app: ASGIApp, echo_header: bool = True, forward_header: bool = False):
        self.app, self.echo_header, self.forward_header = app, echo_header, forward_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id, from_client = pick_request_id(incoming)
        if self.forward_header and request_id != incoming:
            headers = MutableHeaders(scope=scope)
            del headers[REQUEST_ID_HEADER]
            headers.append(REQUEST_ID_HEADER, request_id)
        state = scope.setdefault("state", {})
        state["request_id"], state["request_id_from_client"] = request_id, from_client

        async def send_with_request_id(message: Message) -> None:
            if self.echo_header and message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_request_id)
