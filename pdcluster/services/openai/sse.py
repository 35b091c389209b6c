"""Server-sent events: one ``data: <json>`` event per chunk, ``data: [DONE]``
at the end, and an error event (then ``[DONE]``) when a stream fails after
its 200 has gone out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdcluster.services.openai.errors import OpenAIError

DONE = b"data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


def sse_error(err: OpenAIError) -> bytes:
    """The error event OpenAI clients understand (the official client raises
    ``APIError`` on a chunk carrying ``error``)."""
    return sse_event(err.payload())


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, so a
    client that goes away (cancellation, or a send that fails) closes the
    backend's generator at once -- which is what aborts the request."""
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                           **(headers or {})})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):   # we may be here *because* of a cancel
                    await aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:   # ASGI >= 2.4 servers report a gone client this way: nothing to answer
            pass
