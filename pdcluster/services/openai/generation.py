"""Running one generation for an HTTP request: to completion, or as an SSE
stream -- and stopping the backend's generator the moment the client goes
away, because closing that generator is what aborts the request and frees
its KV everywhere.

    non-streaming:  race(collect(backend), client disconnect)
    streaming:      race(first chunk, client disconnect) -> 200 + SSE body
                    (a failure before the first chunk is a plain HTTP error;
                     after it, an error event then [DONE])
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

from pdcluster.services.backend import BackendError, BackendFailure, for_client
from pdcluster.services.messages import TokenDelta
from pdcluster.services.openai.errors import OpenAIError, from_backend_error, record_backend_error
from pdcluster.services.openai.formats import ResponseFormat, Tally
from pdcluster.services.openai.responses import ChatCompletionResponse, CompletionResponse
from pdcluster.services.openai.sse import DONE, SSEResponse, sse_error

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(OpenAIError):
    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed_request")


def _truncated() -> BackendFailure:
    return for_client(BackendFailure("the backend's stream ended without a finish reason; retry the request"))


async def _aclose(chunks: AsyncIterator[TokenDelta]) -> None:
    """Close the backend's generator: this is what aborts its request."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    # Only called once the body is read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work``, but cancel it and raise ``ClientGone`` if the client
    disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:   # we were cancelled (e.g. Ray Serve saw the disconnect)
        task.cancel()
        watcher.cancel()
        await asyncio.wait({task})   # the generator must be idle before anyone closes it
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    if watcher.exception() is not None:   # this server cannot tell us about disconnects: just wait
        log.warning("cannot watch for client disconnects: %r", watcher.exception())
        return await task
    task.cancel()
    await asyncio.wait({task})   # let the backend's cancellation run; its outcome no longer matters
    raise ClientGone()


async def _collect(chunks: AsyncIterator[TokenDelta], tally: Tally) -> Tally:
    async for chunk in chunks:
        tally.add(chunk)
        if tally.finished:   # every choice (n > 1 merges n streams)
            return tally
    raise _truncated()


async def complete(request: Request, chunks: AsyncIterator[TokenDelta], tally: Tally,
                   fmt: ResponseFormat) -> CompletionResponse | ChatCompletionResponse:
    """The whole response; backend errors propagate as their typed errors."""
    try:
        return fmt.response(await race_disconnect(request, _collect(chunks, tally)))
    finally:
        await _aclose(chunks)


async def stream(request: Request, chunks: AsyncIterator[TokenDelta], tally: Tally, fmt: ResponseFormat,
                 include_usage: bool) -> SSEResponse:
    """Waits for the first chunk (so overload, bad input and no-replica
    answer their own status codes), then streams the rest."""
    try:
        first = await race_disconnect(request, anext(chunks, None))
    except BaseException:
        await _aclose(chunks)
        raise
    return SSEResponse(_sse_body(first, chunks, tally, fmt, include_usage))


async def _sse_body(first: TokenDelta | None, chunks: AsyncIterator[TokenDelta], tally: Tally,
                    fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[bytes]:
    error: OpenAIError | None = None
    try:
        opening = fmt.opening()
        if opening is not None:
            yield opening
        chunk = first
        while chunk is not None:
            tally.add(chunk)
            event = fmt.event(chunk, tally)   # None: nothing to show yet
            if event is not None:
                yield event
            if tally.finished:
                break
            chunk = await anext(chunks, None)
        if not tally.finished:
            raise _truncated()
        if include_usage:
            yield fmt.usage(tally.usage())
    except BackendError as exc:
        record_backend_error(exc, fmt.id, where="mid-stream")
        error = from_backend_error(exc)
    except Exception:
        log.exception("stream %s failed mid-way", fmt.id)
        error = OpenAIError(500, "internal server error mid-stream; retry the request",
                            type="server_error", code="internal_error")
    finally:
        await _aclose(chunks)
    if error is not None:
        yield sse_error(error)
    yield DONE
