"""One request's stream at the gateway, as one loop: admission, the
deadlines, failover and admission's first-token sample are its state, and
each chunk waits under one timer.

    admit (429 here) ─> attempt 1 (its placement) ─chunks─┐
                        attempt 2 (resumed elsewhere) ─────┤─> StreamRelay.chunks() ─> the client
                        ...  (at most max_failovers)       │   one wait a chunk, its timer the
                                                           │   nearest deadline (deadlines.py)

An attempt (``Attempts``: ClusterBackend) streams one replica call's chunks,
a hand-off's "waiting" markers among them (not sent on; they re-arm the
inter-token deadline).  A lost replica -- ReplicaLost from the attempt, or
its inter-token deadline -- resumes the stream on another replica from
prompt + the tokens sent (the rule is failover.py's; ``resume`` raises the
loss's error where it does not resume).  Closing the stream (client gone,
error) closes the attempt, which cancels its replica call."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from pdcluster.services.gateway.admission import Ticket
from pdcluster.services.gateway.deadlines import Deadlines
from pdcluster.services.gateway.failover import ReplicaLost
from pdcluster.services.gateway.failover_log import PendingSpan
from pdcluster.services.gateway.placement import Placement
from pdcluster.services.gateway.resume import StreamProgress, with_stream_seed
from pdcluster.services.messages import GenerateRequest, TokenDelta

T = TypeVar("T")


class Attempts(Protocol):
    """What the relay asks of the backend."""
    request_timeout_s: float
    inter_token_timeout_s: float
    first_token_timeout_s: float

    async def admit(self, req: GenerateRequest) -> Ticket: ...

    def first_attempt(self, req: GenerateRequest, placement: Placement,
                      progress: StreamProgress) -> AsyncIterator[TokenDelta]: ...

    async def resume(self, req: GenerateRequest, progress: StreamProgress, lost: ReplicaLost,
                     pending: PendingSpan | None) -> tuple[AsyncIterator[TokenDelta], PendingSpan]: ...

    def resumed(self, pending: PendingSpan, req: GenerateRequest, replica: str) -> None: ...


class StreamRelay:
    def __init__(self, attempts: Attempts, req: GenerateRequest):
        self.attempts, self.req = attempts, req
        self.progress = StreamProgress(len(req.prompt_token_ids), req.params.max_tokens)
        self.pending: PendingSpan | None = None  # a failover whose new replica has not answered yet
        self.first_sent = False
        self.deadlines: Deadlines | None = None

    async def chunks(self) -> AsyncIterator[TokenDelta]:
        ticket = await self.attempts.admit(self.req)  # or 429
        try:
            self.req = with_stream_seed(self.req)  # so a failover's hop draws what the lost replica would have
            first_token_s = max(self.attempts.first_token_timeout_s, 3 * ticket.placement.predicted_ttft_s)
            self.deadlines = Deadlines.starting(asyncio.get_running_loop().time(), self.attempts.request_timeout_s,
                                                self.attempts.inter_token_timeout_s, first_token_s)
            attempt = self.attempts.first_attempt(self.req, ticket.placement, self.progress)
            gap_armed = False  # the first attempt's inter-token deadline starts with its first chunk
            try:
                while True:
                    try:
                        chunk = await self._within_deadlines(anext(attempt, None), gap_armed)
                    except ReplicaLost as lost:
                        await attempt.aclose()
                        attempt, self.pending = await self._within_deadlines(
                            self.attempts.resume(self.req, self.progress, lost, self.pending), gap_armed=False)
                        gap_armed = True  # a resumed attempt: the client is already waiting
                        continue
                    if chunk is None:
                        return
                    gap_armed = True
                    if chunk.waiting:  # a hand-off in line for a decode seat or KV: the gap starts again
                        continue
                    if self.pending is not None:  # the new replica's first token: the pause is over
                        self.attempts.resumed(self.pending, self.req, self.progress.replica or chunk.worker_name)
                        self.pending = None
                    self.progress.add(chunk)
                    ticket.first_token(len(chunk.token_ids), chunk.worker_name, chunk.num_cached_tokens)
                    self.first_sent = True
                    yield chunk
            finally:
                await attempt.aclose()  # client gone or failed: the attempt's replica call is cancelled
        finally:
            ticket.close()

    async def _within_deadlines(self, awaitable: Awaitable[T], gap_armed: bool) -> T:
        """``awaitable``, or the error of the deadline that passes first (deadlines.py)."""
        loop = asyncio.get_running_loop()
        end_s, which = self.deadlines.next_wait(loop.time(), self.first_sent, gap_armed)
        timer = asyncio.timeout_at(end_s if end_s < math.inf else None)
        try:
            async with timer:
                return await awaitable
        except TimeoutError:
            if not timer.expired():
                raise
            raise self.deadlines.expired(which, self.progress.replica) from None
