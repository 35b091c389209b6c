"""The gateway's per-request loop (pdcluster/services/gateway/relay.py) over fake
attempts, and the deadline rule it waits under (deadlines.py) as a table.  The
real cluster runs the same loop in tests/integration/faults (deadlines, failover).

No verdict here rests on how fast the machine is: a deadline that must pass
faces an attempt that never answers, and one that must not pass faces chunks
that arrive without the loop ever waiting (an async generator that yields at
once never suspends, so no timer can fire in between)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import pytest

from pdcluster.services.backend import BackendFailure, BackendOverloaded, BackendTimeout
from pdcluster.services.gateway.deadlines import Deadline, Deadlines
from pdcluster.services.gateway.failover import FailoverReason, ReplicaLost
from pdcluster.services.gateway.relay import StreamRelay
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.sampling_params import greedy
from pdcluster.services.messages import GenerateRequest, TokenDelta

R, F, G = Deadline.REQUEST, Deadline.FIRST_TOKEN, Deadline.INTER_TOKEN


@pytest.mark.parametrize("request_s, first_s, gap_s, first_sent, gap_armed, expected", [
    (300, 5, 30, False, False, (5, F)),          # waiting for the first token
    (300, math.inf, 30, False, False, (300, R)),  # no first-token bound: the request's end
    (300, 500, 30, False, False, (300, R)),      # a first-token bound past the end is the end
    (300, 5, 30, True, False, (300, R)),         # the first token went out: its bound is over
    (300, 5, 2, True, True, (12, G)),            # an armed gap, from now (10)
    (300, 5, 2, False, True, (5, F)),            # a resumed attempt before the first token: the nearer
    (12, 50, 2, True, True, (12, R)),            # a tie: the request's own end wins
])
def test_the_next_wait_ends_at_the_nearest_deadline(request_s, first_s, gap_s, first_sent, gap_armed, expected):
    d = Deadlines.starting(0.0, request_s, gap_s, first_s)
    assert d.next_wait(10.0, first_sent, gap_armed) == expected


def test_a_passed_deadline_names_its_setting():
    d = Deadlines.starting(0.0, 300.0, 30.0, 6.0)
    assert "admission.first_token_timeout_s" in str(d.expired(F, "r1"))
    assert "admission.request_timeout_s" in str(d.expired(R, "r1"))
    lost = d.expired(G, "replica-a")
    assert isinstance(lost, ReplicaLost) and lost.reason is FailoverReason.INTER_TOKEN_DEADLINE
    assert lost.replica == "replica-a" and isinstance(lost.final_error(), BackendTimeout)


@dataclass
class _Placement:
    predicted_ttft_s: float = 0.0


@dataclass
class _Ticket:
    placement: _Placement = field(default_factory=_Placement)
    firsts: list[int] = field(default_factory=list)
    closed: bool = False

    def first_token(self, num_tokens: int = 1, replica: str = "", cached_tokens: int = 0) -> None:
        self.firsts.append(num_tokens)

    def close(self) -> None:
        self.closed = True


class _Attempts:
    """The relay's backend: attempts given as generator functions, one per call."""

    def __init__(self, *attempts, request_timeout_s=300.0, inter_token_timeout_s=30.0, first_token_timeout_s=math.inf,
                 refuse: Exception | None = None):
        self.attempts = list(attempts)
        self.request_timeout_s, self.inter_token_timeout_s = request_timeout_s, inter_token_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.refuse, self.ticket = refuse, _Ticket()
        self.losses: list[FailoverReason] = []
        self.resumed_on: list[str] = []

    async def admit(self, req):
        if self.refuse is not None:
            raise self.refuse
        return self.ticket

    def first_attempt(self, req, placement, progress):
        return self.attempts.pop(0)()

    async def resume(self, req, progress, lost, pending):
        self.losses.append(lost.reason)
        if not self.attempts:
            raise lost.final_error() from lost
        progress.failed_over(lost.reason.value, lost.replica, avoid=True)
        return self.attempts.pop(0)(), f"span{len(self.losses)}"

    def resumed(self, pending, req, replica):
        self.resumed_on.append(f"{pending}@{replica}")


def _request():
    return GenerateRequest("r1", list(range(8)), greedy(8), RoutingHeader((), 8))


async def _drain(attempts):
    return [c async for c in StreamRelay(attempts, _request()).chunks()]


async def test_the_request_deadline_covers_the_wait_for_the_first_token():
    async def never():
        await asyncio.sleep(3600)
        yield TokenDelta([1], "never")

    attempts = _Attempts(never, request_timeout_s=0.1)
    with pytest.raises(BackendTimeout, match="admission.request_timeout_s"):
        await _drain(attempts)
    assert attempts.ticket.closed


async def test_a_first_token_later_than_its_deadline_aborts_the_attempt():
    cancelled = asyncio.Event()

    async def stalled():
        try:
            await asyncio.sleep(3600)
            yield TokenDelta([1], "never")
        finally:
            cancelled.set()  # the replica call behind it is cancelled

    with pytest.raises(BackendTimeout, match="admission.first_token_timeout_s"):
        await _drain(_Attempts(stalled, first_token_timeout_s=0.05))
    assert cancelled.is_set()


async def test_the_first_token_deadline_ends_with_the_first_token():
    async def slow_after_first():
        yield TokenDelta([1], "a")   # at once: the loop does not wait for it
        await asyncio.sleep(0.2)     # past the first-token bound, within the inter-token one
        yield TokenDelta([2], "b", "length")

    attempts = _Attempts(slow_after_first, first_token_timeout_s=0.05)
    assert [c.text for c in await _drain(attempts)] == ["a", "b"]
    assert attempts.ticket.firsts == [1, 1] and attempts.ticket.closed


async def test_a_silent_attempt_fails_over_and_the_stream_goes_on_elsewhere():
    cancelled = asyncio.Event()

    async def stalls_after_two():
        try:
            yield TokenDelta([1], "a", streamed_by="replica-a")
            yield TokenDelta([2], "b", streamed_by="replica-a")
            await asyncio.sleep(3600)
            yield TokenDelta([9], "never")
        finally:
            cancelled.set()

    async def resumed():
        yield TokenDelta([3], "c", streamed_by="replica-b", worker_name="replica-b")
        yield TokenDelta([4], "d", "length", streamed_by="replica-b")

    attempts = _Attempts(stalls_after_two, resumed, inter_token_timeout_s=0.05)
    assert [c.text for c in await _drain(attempts)] == ["a", "b", "c", "d"]
    assert cancelled.is_set() and attempts.losses == [FailoverReason.INTER_TOKEN_DEADLINE]
    assert attempts.resumed_on == ["span1@replica-b"]  # the failover's span ends at the new first token


async def test_a_lost_replica_with_nowhere_to_go_ends_the_stream_with_its_error():
    async def dies():
        yield TokenDelta([1], "a")
        raise ReplicaLost(FailoverReason.REPLICA_DIED, "gone", "replica-a", cause=BackendFailure("the replica died"))

    attempts = _Attempts(dies)
    chunks = []
    with pytest.raises(BackendFailure, match="the replica died"):  # the loss's own error, for the client
        async for c in StreamRelay(attempts, _request()).chunks():
            chunks.append(c.text)
    assert chunks == ["a"] and attempts.losses == [FailoverReason.REPLICA_DIED]
    assert attempts.ticket.closed


async def test_waiting_markers_are_not_sent_and_do_not_count_as_the_first_token():
    async def hand_off_in_line():
        yield TokenDelta.waiting_on("")
        yield TokenDelta([1], "a", "length")

    attempts = _Attempts(hand_off_in_line)
    assert [c.text for c in await _drain(attempts)] == ["a"]
    assert attempts.ticket.firsts == [1]


async def test_a_client_that_leaves_closes_the_attempt_and_the_ticket():
    closed = asyncio.Event()

    async def endless():
        try:
            for i in range(1 << 20):
                yield TokenDelta([i], "x")
        finally:
            closed.set()

    attempts = _Attempts(endless)
    stream = StreamRelay(attempts, _request()).chunks()
    assert (await anext(stream)).text == "x"
    await stream.aclose()
    assert closed.is_set() and attempts.ticket.closed


async def test_a_refusal_at_admission_starts_no_attempt():
    attempts = _Attempts(refuse=BackendOverloaded("predicted past the SLO"))
    with pytest.raises(BackendOverloaded):
        await _drain(attempts)
    assert not attempts.ticket.closed  # no ticket was issued
