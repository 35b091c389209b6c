"""The deadlines a request runs under, as wrappers of its chunk stream.

    end-to-end   with_deadlines: from arrival to the last chunk (504, or an SSE error event)
    first token  with_deadlines: from arrival to the first chunk (504): a request whose first
                 token is far later than its admission predicted is aborted on every stage,
                 not left waiting for the end-to-end deadline
    inter-token  with_gap_deadline: per attempt, the gap between chunks; passing it is a
                 lost replica (ReplicaLost), so the stream may fail over (failover.py)

Either cancels the stream where it waits, which cancels the replica calls
it has in flight (their ``finally`` blocks abort and release)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

from pdcluster.observability import metrics
from pdcluster.services.backend import BackendTimeout, for_client
from pdcluster.services.messages import TokenDelta
from pdcluster.services.gateway.failover import FailoverReason, ReplicaLost
from pdcluster.services.gateway.resume import StreamProgress


async def with_deadlines(chunks: AsyncIterator[TokenDelta], request_timeout_s: float,
                         inter_token_timeout_s: float, first_token_timeout_s: float = math.inf
                         ) -> AsyncIterator[TokenDelta]:
    """``chunks``, or BackendTimeout once the end-to-end deadline passes, no
    first chunk came within ``first_token_timeout_s``, or, after the first
    chunk, no chunk came for ``inter_token_timeout_s``.  The timeout cancels
    ``chunks`` where it waits, which cancels the replica calls it has in
    flight (their ``finally`` blocks abort and release)."""
    loop = asyncio.get_running_loop()
    end_s = loop.time() + request_timeout_s
    first_ends_s = min(end_s, loop.time() + first_token_timeout_s)
    first = True
    try:
        while True:
            gap_ends_s = first_ends_s if first else min(end_s, loop.time() + inter_token_timeout_s)
            try:
                async with asyncio.timeout_at(gap_ends_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if first and gap_ends_s < end_s:
                    metrics.count_deadline("first_token")
                    raise for_client(BackendTimeout(
                        f"no first token within {first_token_timeout_s:.0f} s (admission.first_token_timeout_s, "
                        "or 3x the predicted time to first token when longer); the request was aborted: retry it"
                    )) from None
                metrics.count_deadline("request" if gap_ends_s >= end_s else "inter_token")
                if gap_ends_s >= end_s:
                    raise for_client(BackendTimeout(f"the request ran past its {request_timeout_s:g} s deadline "
                                                    "(admission.request_timeout_s) and was aborted")) from None
                raise for_client(BackendTimeout(f"no token for {inter_token_timeout_s:g} s "
                                                "(admission.inter_token_timeout_s); the request was aborted: "
                                                "retry it")) from None
            first = False
            yield chunk
    finally:
        await chunks.aclose()


async def with_gap_deadline(chunks: AsyncIterator[TokenDelta], inter_token_timeout_s: float, from_start: bool,
                            progress: StreamProgress) -> AsyncIterator[TokenDelta]:
    """``chunks`` (one attempt), or ReplicaLost(INTER_TOKEN_DEADLINE) once no
    chunk came for ``inter_token_timeout_s`` -- after its first chunk, or
    from the start for a resumed attempt (the client is already waiting).
    The timeout cancels ``chunks`` where it waits (the replica aborts)."""
    waiting_first = not from_start
    try:
        while True:
            try:
                if waiting_first:
                    chunk = await anext(chunks)
                else:
                    async with asyncio.timeout(inter_token_timeout_s):
                        chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                metrics.count_deadline("inter_token")
                timeout = for_client(BackendTimeout(f"no token for {inter_token_timeout_s:g} s "
                                                    "(admission.inter_token_timeout_s); the request was aborted: "
                                                    "retry it"))
                raise ReplicaLost(FailoverReason.INTER_TOKEN_DEADLINE, str(timeout), progress.replica,
                                  cause=timeout) from None
            waiting_first = False
            yield chunk
    finally:
        await chunks.aclose()
