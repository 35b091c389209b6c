"""The replica's side of the token channel (pdcluster/services/token_channel.py):
one authenticated connection per gateway inbox, opened by the first call that
names it, shared by every later one; ``over_channel`` sends a call's deltas
there and tells Serve only how many it sent.

An inbox it cannot reach (another host's firewall, a gateway gone) costs
nothing but the Serve path: the call's deltas go through Serve as before, and
the address is not tried again for ``RETRY_AFTER_S``.  A connection that
breaks mid-stream hands the rest of that stream to Serve, after a
ChannelDone that counts what the channel took."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from pdcluster.services.delta_wire import pack_delta
from pdcluster.services.messages import ChannelDone, GenerateRequest, ReplyTo, TokenDelta
from pdcluster.services.token_channel import HANDSHAKE_TIMEOUT_S, ChannelRefused, answer_challenge, frame
from pdcluster.transfer.auth import ClusterSecret

log = logging.getLogger("pdcluster.worker")
RETRY_AFTER_S = 30.0          # an inbox that could not be reached is tried again after this
BACKLOG_BYTES = 1 << 20       # unsent bytes past which a send waits for the socket to drain


class Link:
    """One open connection to an inbox."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer

    @property
    def open(self) -> bool:
        """Not closed by either side (the inbox never writes after the challenge: EOF is its close)."""
        return not self._writer.is_closing() and not self._reader.at_eof()

    async def send(self, key: str, delta: TokenDelta) -> None:
        """Raises ConnectionError when the connection is gone."""
        writer = self._writer
        if writer.is_closing():
            raise ConnectionResetError("the token channel closed")
        writer.write(frame(pack_delta(key, delta)))
        if writer.transport.get_write_buffer_size() > BACKLOG_BYTES:
            await writer.drain()

    def close(self) -> None:
        self._writer.close()


class TokenSender:
    def __init__(self, replica: str, secret: bytes | None, clock=time.monotonic):
        self.replica = replica
        self._secret = ClusterSecret.of(secret)
        self._clock = clock
        self._links: dict[tuple[str, int, str], Link] = {}
        self._locks: dict[tuple[str, int, str], asyncio.Lock] = {}
        self._unreachable: dict[tuple[str, int, str], float] = {}  # address -> when it may be tried again
        self.num_fallbacks = 0  # calls streamed through Serve although they named an inbox

    async def link(self, to: ReplyTo) -> Link | None:
        """The open connection to ``to``'s inbox, connecting once; None when it cannot be reached."""
        address = (to.host, to.port, to.inbox)
        link = self._links.get(address)
        if link is not None and link.open:
            return link
        if self._clock() < self._unreachable.get(address, 0.0):
            return None
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            link = self._links.get(address)
            if link is not None and link.open:
                return link
            try:
                link = await self._connect(to)
            except (OSError, ChannelRefused, TimeoutError, asyncio.IncompleteReadError) as exc:
                self._unreachable[address] = self._clock() + RETRY_AFTER_S
                log.warning("%s: token inbox %s at %s:%d unreachable (%s); its streams go through Serve",
                            self.replica, to.inbox, to.host, to.port, exc)
                return None
            self._links[address] = link
            return link

    async def _connect(self, to: ReplyTo) -> Link:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(to.host, to.port)
            try:
                await answer_challenge(reader, writer, self._secret, self.replica, to.inbox)
            except BaseException:
                writer.close()
                raise
        return Link(reader, writer)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


async def over_channel(sender: TokenSender | None, request: GenerateRequest,
                       deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta | ChannelDone]:
    """What a streaming call yields to Serve: ``deltas`` themselves when the call names no inbox
    (or it cannot be reached), else only ChannelDone(n) once the deltas went to the inbox --
    before the call's error, when it raises one."""
    to = request.reply_to
    link = await sender.link(to) if sender is not None and to is not None else None
    if link is None and to is not None and sender is not None:
        sender.num_fallbacks += 1
    sent = 0
    async with aclosing(deltas):
        try:
            async for delta in deltas:
                if link is not None:
                    try:
                        await link.send(to.key, delta)
                        sent += 1
                        continue
                    except ConnectionError as exc:
                        log.warning("%s: the token channel broke mid-stream (%s); the rest goes through Serve",
                                    sender.replica, exc)
                        link = None
                        sender.num_fallbacks += 1
                        yield ChannelDone(sent)
                yield delta
        except (GeneratorExit, asyncio.CancelledError):
            raise
        except BaseException:
            if link is not None:
                yield ChannelDone(sent)  # the frames before the error come first
            raise
    if link is not None:
        yield ChannelDone(sent)
