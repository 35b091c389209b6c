"""One call's replies in the order the replica made them, when its deltas
come over the token channel and the rest over Serve.

The replica sends every delta as a frame, then, over Serve, ChannelDone(n)
(n frames sent) and the call's end or its error.  The two connections race:
``Done(3), end`` can arrive before frame 3.  What Serve says is acted on at
once until a ChannelDone was seen, and after one only once that many frames
were taken (``deliverable``).  A replica that dies sends no ChannelDone: its
death is acted on at once, and frames still in flight are dropped with the
mailbox -- the stream resumes from the tokens the client got.  A delta that
Serve itself carries (the replica could not reach the inbox, or the gateway
has none: ``token_channel: false``) is in Serve's order, after the
ChannelDone that ended the channel's part.  Either way the Serve call is read
by its own watcher task, whose end is the call's end on its replica."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pdcluster.services.gateway.token_inbox import END, ERROR, FRAME, SERVE
from pdcluster.services.messages import ChannelDone, TokenDelta


def deliverable(taken: int, expected: int | None) -> bool:
    """Whether the next thing Serve said may be acted on, with ``taken`` frames taken and a
    ChannelDone of ``expected`` frames seen (None: none yet)."""
    return expected is None or taken >= expected


async def watch_call(stream: AsyncIterator[Any], box: asyncio.Queue) -> None:
    """Copies what the Serve call says into the mailbox: its items, then END or ERROR."""
    try:
        async for item in stream:
            box.put_nowait((SERVE, item))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - the reader raises it in order
        box.put_nowait((ERROR, exc))
    else:
        box.put_nowait((END, None))


async def ordered_replies(box: asyncio.Queue) -> AsyncIterator[TokenDelta]:
    """The call's deltas in the replica's order, from its mailbox (``watch_call`` copies what
    Serve says into it; the inbox, the frames); raises the call's error where the replica raised it."""
    taken, expected = 0, None
    held: deque = deque()
    while True:
        if held and deliverable(taken, expected):
            kind, item = held.popleft()
            if kind == END:
                return
            if kind == ERROR:
                raise item
            if isinstance(item, ChannelDone):
                expected = item.frames
            else:
                yield item  # a delta Serve carried
            continue
        kind, item = await box.get()
        if kind == FRAME:
            taken += 1
            yield item
        else:
            held.append((kind, item))
