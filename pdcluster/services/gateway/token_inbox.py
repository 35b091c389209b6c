"""The gateway replica's token inbox: where engine replicas push the deltas of
the streams they serve for it (pdcluster/services/token_channel.py), one
mailbox per call.

    gateway                                        engine replica
    inbox.open() -> ReplyTo(host, port, id, key)
    handle.generate.remote(req + reply_to)  ────►  over_channel(): each delta ─┐
    mailbox <── (FRAME, delta) ◄── connection (one per replica) ◄────────────┘
    mailbox <── (SERVE, ChannelDone(n)), (END | ERROR) ◄── the Serve call itself

Entries come from two connections, so their order is restored by the reader
(pdcluster/services/gateway/reply_order.py).  A frame for a closed mailbox
(a stream the gateway stopped reading) is dropped and counted; a malformed
frame or a failed challenge closes its connection, counted, and touches no
other stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
from dataclasses import dataclass

from pdcluster.services.delta_wire import MAX_FRAME_BYTES, BadFrame, unpack_delta
from pdcluster.services.messages import ReplyTo
from pdcluster.services.token_channel import HANDSHAKE_TIMEOUT_S, ChannelRefused, challenge_sender, read_frame
from pdcluster.transfer.auth import ClusterSecret

log = logging.getLogger("pdcluster.gateway")

FRAME, SERVE, END, ERROR = "frame", "serve", "end", "error"  # a mailbox entry's kind


@dataclass
class InboxCounters:
    connections: int = 0
    refused: int = 0         # failed the challenge or spoke something else
    bad_frames: int = 0      # malformed after the challenge: the connection closed
    frames: int = 0
    dropped: int = 0         # for a mailbox already closed


class TokenInbox:
    def __init__(self, host: str, secret: bytes | None):
        self.host = host
        self.port = 0
        self.inbox_id = secrets.token_hex(8)
        self.counters = InboxCounters()
        self._secret = ClusterSecret.of(secret)
        self._boxes: dict[str, asyncio.Queue] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listens on an ephemeral port of ``host`` (call from the loop the streams are read on)."""
        self._server = await asyncio.start_server(self._serve, self.host, 0, limit=2**20)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("token inbox %s listening on %s:%d", self.inbox_id, self.host, self.port)

    def open(self) -> tuple[ReplyTo, asyncio.Queue]:
        """A fresh mailbox and the address a call names to reach it; close it with ``close``."""
        key = secrets.token_hex(16)
        box: asyncio.Queue = asyncio.Queue()
        self._boxes[key] = box
        return ReplyTo(self.host, self.port, self.inbox_id, key), box

    def close(self, key: str) -> None:
        self._boxes.pop(key, None)

    def view(self) -> dict:
        """Its counters (the gateway's /metrics)."""
        return dataclasses.asdict(self.counters)

    @property
    def open_mailboxes(self) -> int:
        return len(self._boxes)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        replica = "?"
        try:
            try:
                async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                    replica = await challenge_sender(reader, writer, self._secret, self.inbox_id)
            except (ChannelRefused, TimeoutError, asyncio.IncompleteReadError) as exc:
                self.counters.refused += 1
                log.warning("token inbox %s refused a connection: %s", self.inbox_id, exc)
                return
            self.counters.connections += 1
            await self._read_deltas(reader, replica)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the replica went away; its calls end through Serve
        finally:
            self._connections.discard(task)
            writer.close()

    async def _read_deltas(self, reader: asyncio.StreamReader, replica: str) -> None:
        boxes, counters = self._boxes, self.counters
        while True:
            try:
                key, delta = unpack_delta(await read_frame(reader, MAX_FRAME_BYTES))
            except (BadFrame, ChannelRefused) as exc:
                counters.bad_frames += 1
                log.error("token inbox %s: a malformed frame from %s (%s); closing its connection",
                          self.inbox_id, replica, exc)
                return
            box = boxes.get(key)
            if box is None:
                counters.dropped += 1
                continue
            counters.frames += 1
            box.put_nowait((FRAME, delta))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(BaseException):
                await task
