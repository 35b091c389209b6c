"""Several choices for one request (``n`` > 1), sharing one prefill.

Choice 0 goes first.  Its first chunk means its prompt is prefilled and the
prompt's full blocks sit in the prefix cache of the replica named in that
chunk (``worker_name``); choices 1..n-1 then go, pinned to that replica, and
find the prompt cached: each computes only the tail past its last full
block (and samples its own first token), then decodes on its own::

    choice 0   [prefill whole prompt] -> first token -> decode ...
    choice i                 (after choice 0's first token) [cache hit + tail] -> decode ...

The n streams are merged into one, each chunk tagged with its choice's
``index``.  Each choice has its own random stream: with ``seed``, choice i
samples with ``choice_seed(seed, i)`` (choice 0 with ``seed`` itself, so
n = 1 is unchanged); without, each draws from its own OS-seeded generator.
Prompt logprobs (echo) are asked of choice 0 only: the prompt is the same,
and a request asking them skips the prefix cache.

Closing the merged stream closes every choice's stream (which aborts them
and frees their blocks); a choice that fails fails the request."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from pdcluster.services.messages import GenerateRequest, StreamDraw, TokenDelta

_MASK64 = (1 << 64) - 1

Generate = Callable[[GenerateRequest], AsyncIterator[TokenDelta]]


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed`` for choice 0, else a splitmix64 mix
    of (seed, index) -- deterministic, and far apart for neighbouring seeds."""
    if index == 0:
        return seed
    z = ((seed & _MASK64) + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def choice_request(request: GenerateRequest, index: int, prefill_worker: str | None = None) -> GenerateRequest:
    """Choice ``index`` of ``request`` (choice 0 is ``request`` itself)."""
    if index == 0:
        return request
    seed = request.draw.seed
    draw = StreamDraw(None if seed is None else choice_seed(seed, index), prompt_logprobs=None)
    routing = dataclasses.replace(request.routing, prefer_worker=prefill_worker or request.routing.prefer_worker)
    return dataclasses.replace(request, request_id=f"{request.request_id}-{index}", own_draw=draw, routing=routing)


def _tagged(chunk: TokenDelta, index: int) -> TokenDelta:
    return chunk if chunk.index == index else dataclasses.replace(chunk, index=index)


def generate_choices(generate: Generate, request: GenerateRequest, n: int) -> AsyncIterator[TokenDelta]:
    """The n choices of ``request`` as one stream (see the module docstring)."""
    return generate(request) if n == 1 else _merged(generate, request, n)


async def _aclose(stream: AsyncIterator[TokenDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def _merged(generate: Generate, request: GenerateRequest, n: int) -> AsyncIterator[TokenDelta]:
    queue: asyncio.Queue = asyncio.Queue()
    pumps: list[asyncio.Task] = []
    streams: list[AsyncIterator[TokenDelta]] = [generate(request)]
    try:
        head = await anext(streams[0], None)
        if head is None:
            return
        yield _tagged(head, 0)
        pumps.append(asyncio.ensure_future(_pump(streams[0], 0, queue)))
        for i in range(1, n):
            streams.append(generate(choice_request(request, i, head.worker_name or None)))
            pumps.append(asyncio.ensure_future(_pump(streams[i], i, queue)))
        open_streams = n
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in pumps:
            task.cancel()
        if pumps:
            await asyncio.gather(*pumps, return_exceptions=True)   # a generator must be idle before it closes
        for s in streams:
            await _aclose(s)


async def _pump(stream: AsyncIterator[TokenDelta], index: int, queue: asyncio.Queue) -> None:
    """Moves one choice's chunks to the merged queue; None when it ends, the
    exception when it fails."""
    try:
        async for chunk in stream:
            queue.put_nowait(_tagged(chunk, index))
        queue.put_nowait(None)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the merged stream, which raises it
        queue.put_nowait(exc)
