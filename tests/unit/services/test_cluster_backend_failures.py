"""ClusterBackend off the happy path, with fake Serve handles: the prefill
lease is released on the replica that holds it whenever no decode token
came back, and the deadlines abort a stalled stream (the real cluster runs
the same paths in tests/integration/faults)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect

import pytest

from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from pdcluster.services.backend import BackendKVTransferFailed, BackendOverloaded, BackendTimeout
from pdcluster.services.gateway.failover import FailoverReason, ReplicaLost, decode_call_over
from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.messages import GenerateRequest
from pdcluster.services.gateway.cluster_backend import ClusterBackend, seat_retry_delay_s
from pdcluster.services.sampling_params import greedy
from pdcluster.services.messages import TokenDelta
from tests.unit.services.serve_fakes import HANDOFF, SERVERS, FakeResponse, FakeStream


class _Handles:
    def __init__(self, decode_stream):
        self.calls: list[tuple[str, tuple, dict]] = []
        self.decode_stream = decode_stream

    def pool(self, name):
        handles = self

        class Handle:
            def options(self, **_):
                return self

            def __getattr__(self, method):
                class Method:
                    def remote(self, *args, **kwargs):
                        # The call must fit the real deployment method's signature.
                        inspect.signature(getattr(SERVERS[name], method)).bind(None, *args, **kwargs)
                        handles.calls.append((f"{name}.{method}", args, kwargs))
                        if method == "prefill":
                            if getattr(handles, "prefill_errors", None):
                                return FakeResponse(None, handles.prefill_errors.pop(0))
                            return FakeResponse(HANDOFF)
                        if method == "release":
                            return FakeResponse(True)
                        if getattr(handles, "next_streams", None):
                            return handles.next_streams.pop(0)
                        return handles.decode_stream
                return Method()
        return Handle()


def _backend(decode_stream, **kw):
    fake = _Handles(decode_stream)
    backend = ClusterBackend({"prefill": fake.pool("prefill"), "decode": fake.pool("decode")},
                             mode="disaggregated", model_name="m", max_model_len=64, block_size=16, **kw)
    return backend, fake


async def _drain(backend):
    chunks = []
    async for c in backend.generate(GenerateRequest("r1", list(range(20)), greedy(8), RoutingHeader((), 20))):
        chunks.append(c)
    return chunks


async def _settle(backend):
    await asyncio.gather(*backend._background)


def _releases(fake):
    return [(args[0].request_id, args[0].routing.target_worker) for name, args, _ in fake.calls
            if name == "prefill.release"]


async def test_a_decode_429_that_outlasts_the_wait_releases_the_lease_on_its_prefill_replica():
    backend, fake = _backend(FakeStream(error=BackendOverloaded("full")), handoff_wait_s=0.0)
    with pytest.raises(BackendOverloaded):
        await _drain(backend)
    await _settle(backend)
    assert _releases(fake) == [("r1", "prefill-x")] and backend.num_lease_releases == 1
    assert backend.admission.in_flight == 0


async def test_a_full_decode_replica_is_offered_the_hand_off_again_not_an_error_mid_stream():
    streams = [FakeStream(error=BackendOverloaded("full")), FakeStream(error=BackendOverloaded("full")),
               FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length")])]
    backend, fake = _backend(None)
    fake.decode_stream = None
    fake.next_streams = streams
    chunks = await _drain(backend)
    await _settle(backend)
    assert [c.text for c in chunks] == ["a", "b", "c"] and backend.num_handoff_waits == 2
    assert _releases(fake) == []  # the third offer pulled it


async def test_an_admitted_request_no_queue_can_take_yet_waits_for_a_seat_instead_of_a_429():
    # A burst beyond every pool's queue (issue 32): admission predicted it within the SLO, so Serve's
    # BackPressureError (prefill) and a full decode replica (its whole-request fallback) mean "offer it
    # again", never a refusal that no measured prediction made.
    backend, fake = _backend(None)
    fake.prefill_errors = [BackPressureError(num_queued_requests=8, max_queued_requests=8)] * 2
    fake.next_streams = [FakeStream(error=BackendOverloaded("decode full")),
                         FakeStream(error=BackendOverloaded("decode full")),
                         FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length")])]
    chunks = await _drain(backend)
    await _settle(backend)
    assert [c.text for c in chunks] == ["a", "b", "c"] and backend.num_seat_waits == 2
    assert [name for name, *_ in fake.calls] == [
        "prefill.prefill", "decode.generate_colocated", "prefill.prefill", "decode.generate_colocated",
        "prefill.prefill", "decode.generate"]
    assert backend.admission.in_flight == 0


def test_seat_offers_back_off_from_50_ms_to_half_a_second():
    assert [seat_retry_delay_s(n) for n in (0, 1, 2, 3, 4, 50)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


async def test_an_overload_after_the_first_token_is_not_offered_again():
    streams = [FakeStream([TokenDelta([6], "b")], error=BackendOverloaded("full"))]
    backend, fake = _backend(None, handoff_wait_s=0.0)
    fake.next_streams = streams
    with pytest.raises(BackendOverloaded):
        await _drain(backend)
    assert backend.num_seat_waits == 0


async def test_client_gone_after_the_first_token_releases():
    backend, fake = _backend(FakeStream([TokenDelta([6], "b")]))
    chunks = backend.generate(GenerateRequest("r1", list(range(20)), greedy(8), RoutingHeader((), 20)))
    first = await anext(chunks)
    assert first.token_ids == [5]
    await chunks.aclose()  # the client left before the decode call
    await _settle(backend)
    assert _releases(fake) == [("r1", "prefill-x")]
    assert [name for name, *_ in fake.calls] == ["prefill.prefill", "prefill.release"]


async def test_a_decoded_stream_leaves_the_lease_to_the_puller():
    backend, fake = _backend(FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length")]))
    chunks = await _drain(backend)
    await _settle(backend)
    assert [c.text for c in chunks] == ["a", "b", "c"] and _releases(fake) == []


async def test_inter_token_deadline_aborts_the_stalled_stream_and_releases_the_lease_once_the_call_ended():
    # Cancelled before its first token, the decode call may be mid-pull: a release from the gateway while
    # it runs would let the prefill replica reuse blocks a one-sided READ is still reading (issue 33).
    # The decode replica releases once its pull ended (pdcluster/services/pools/decode.py) -- if it ran
    # the call at all: one cancelled before it started never does, so the gateway releases too, once
    # the call ended there (tests/unit/services/test_token_channel.py checks the "not before").
    stream = FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length")], stall_after=0)
    backend, fake = _backend(stream, inter_token_timeout_s=0.2)
    with pytest.raises(BackendTimeout, match="no token for 0.2 s"):
        await _drain(backend)
    await _settle(backend)
    assert stream.cancelled  # the decode call was cancelled: the replica aborts, then releases
    assert _releases(fake) == [("r1", "prefill-x")]


@pytest.mark.parametrize("assigned, released", [(True, True), (None, True), (False, True)])
async def test_client_gone_while_the_decode_call_pulls_has_the_lease_released(assigned, released):
    # assigned: a decode replica took the call and may be pulling (it releases; the gateway too, once
    # the call ended there); None: the handle cannot tell (treated as taken); False: cancelled before
    # Serve assigned it, nobody pulls: released at once.
    stream = FakeStream([TokenDelta([6], "b")], stall_after=0, assigned=assigned)  # no token yet
    backend, fake = _backend(stream)
    chunks = backend.generate(GenerateRequest("r1", list(range(20)), greedy(8), RoutingHeader((), 20)))
    assert (await anext(chunks)).token_ids == [5]
    pending = asyncio.ensure_future(anext(chunks))  # the decode call is made and waits on the pull
    while not any(name == "decode.generate" for name, *_ in fake.calls):
        await asyncio.sleep(0.01)
    pending.cancel()  # the client left mid-pull: its task is cancelled
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await pending
    await chunks.aclose()
    await _settle(backend)
    assert stream.cancelled and _releases(fake) == ([("r1", "prefill-x")] if released else [])


async def test_a_consumer_that_stops_at_the_finish_leaves_the_lease_to_the_puller():
    # A whole (non-streamed) response closes the stream as soon as it has its finish reason: the decode
    # replica pulled and released, so no second release goes out for every such request.
    backend, fake = _backend(FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length"),
                                         TokenDelta([], "")]))
    chunks = backend.generate(GenerateRequest("r1", list(range(20)), greedy(8), RoutingHeader((), 20)))
    texts = []
    async for chunk in chunks:
        texts.append(chunk.text)
        if chunk.finish_reason is not None:
            break
    await chunks.aclose()
    await _settle(backend)
    assert texts == ["a", "b", "c"] and _releases(fake) == []


@pytest.mark.parametrize("before_death", [[TokenDelta([6], "b")], [TokenDelta.waiting_on("decode-x")]],
                         ids=["after-its-tokens", "while-it-waited-for-kv"])
async def test_a_decode_replica_that_dies_mid_stream_has_the_lease_released_once_its_call_is_over(before_death):
    # After its tokens: it pulled, but its pull's notification may never have left it (a replica killed
    # 10 tokens after its pull held the lease until its TTL).  A keep-alive is no pull at all.
    backend, fake = _backend(FakeStream(before_death, error=ActorDiedError()), max_failovers=0)
    with pytest.raises(Exception):
        await _drain(backend)
    await _settle(backend)
    assert _releases(fake) == [("r1", "prefill-x")]


async def test_a_keep_alive_is_not_a_decoded_token_for_the_seat_wait():
    # A decode replica that sent only keep-alives and then answered 429 pulled nothing: the hand-off is
    # offered again (the lease holds the blocks), as for a 429 before anything came back.
    streams = [FakeStream([TokenDelta.waiting_on("decode-x")], error=BackendOverloaded("full")),
               FakeStream([TokenDelta([6], "b"), TokenDelta([7], "c", "length")])]
    backend, fake = _backend(None)
    fake.next_streams = streams
    chunks = await _drain(backend)
    await _settle(backend)
    assert [c.text for c in chunks if not c.waiting] == ["a", "b", "c"] and backend.num_handoff_waits == 1
    assert _releases(fake) == []


def test_serve_handles_still_carry_the_assignment_future_the_gateway_reads():
    from ray.serve.handle import _DeploymentResponseBase

    assert "self._replica_result_future" in inspect.getsource(_DeploymentResponseBase.__init__)


@pytest.mark.parametrize("error", [
    BackendKVTransferFailed("the pull broke"),          # the replica answered: its generate ended
    ActorDiedError(),                                   # the replica is gone: it reads nothing
    BackendOverloaded("full"),                          # refused before reserving: it never pulled
])
async def test_a_decode_call_that_ended_without_a_token_releases_at_once(error):
    backend, fake = _backend(FakeStream(error=error), handoff_wait_s=0.0, max_failovers=0)
    with pytest.raises(Exception):
        await _drain(backend)
    await _settle(backend)
    assert _releases(fake) == [("r1", "prefill-x")]


def test_only_an_ended_decode_call_frees_the_gateway_to_release():
    assert decode_call_over(BackendKVTransferFailed("x")) and decode_call_over(BackendOverloaded("x"))
    assert decode_call_over(ReplicaLost(FailoverReason.REPLICA_DIED, "gone"))
    assert decode_call_over(ReplicaLost(FailoverReason.KV_TRANSFER_FAILED, "x", cause=BackendKVTransferFailed("x")))
    assert not decode_call_over(ReplicaLost(FailoverReason.STREAM_BROKEN, "broken"))
    assert not decode_call_over(asyncio.CancelledError()) and not decode_call_over(GeneratorExit())
