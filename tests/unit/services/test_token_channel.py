"""The token channel: a delta's wire format, the inbox's challenge, a replica's
sends and the gateway's ordering of frames against what Serve says -- over
real loopback sockets; Serve's handle is the only stand-in (the real cluster
streams every token this way in tests/integration)."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest

from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.backend import BackendFailure
from pdcluster.services.delta_wire import BadFrame, pack_delta, unpack_delta
from pdcluster.services.token_logprob import TokenLogprob
from pdcluster.services.sampling_params import greedy
from pdcluster.services.gateway.cluster_backend import ClusterBackend
from pdcluster.services.gateway.reply_order import deliverable, ordered_replies, watch_call
from pdcluster.services.gateway.token_inbox import END, ERROR, FRAME, SERVE, TokenInbox
from pdcluster.services.messages import ChannelDone, GenerateRequest, ReplyTo, TokenDelta
from pdcluster.services.pools.token_sender import TokenSender, over_channel
from pdcluster.services.token_channel import frame
from tests.unit.services.serve_fakes import HANDOFF, FakeResponse

SECRET = bytes(range(32))


def _delta(i: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta([i], f"t{i}", finish, num_prompt_tokens=4, streamed_by="colocated-1")


def _request(reply_to: ReplyTo | None = None) -> GenerateRequest:
    return GenerateRequest("r1", [1, 2, 3, 4], greedy(8), RoutingHeader((), 4, 16, 0), reply_to=reply_to)


async def _deltas(n: int, error: BaseException | None = None):
    for i in range(n):
        yield _delta(i, "length" if i == n - 1 and error is None else None)
    if error is not None:
        raise error


async def _drain(box: asyncio.Queue, n: int) -> list:
    return [await asyncio.wait_for(box.get(), 10) for _ in range(n)]


# ---- the wire format -------------------------------------------------------------------------

def test_a_delta_crosses_the_wire_with_every_field():
    d = TokenDelta([5, 6], "ab", "stop", num_prompt_tokens=9, num_cached_tokens=4,
                   logprobs=[TokenLogprob(5, -0.5, ((5, -0.5), (7, -1.25))), TokenLogprob(6, -math.inf)],
                   prompt_logprobs=[TokenLogprob(2, -3.0)], worker_name="prefill-1", streamed_by="decode-2")
    assert unpack_delta(pack_delta("k1", d)) == ("k1", d)
    keepalive = TokenDelta.waiting_on("decode-2")
    assert unpack_delta(pack_delta("k2", keepalive)) == ("k2", keepalive)


@pytest.mark.parametrize("fields, what", [
    ({"key": "k"}, "not msgpack"),  # no maps at all
    (["k", [1], "t", None, 1, 0, None, None, "w", "b"], "a list of 11"),
    (["k", ["1"], "t", None, 1, 0, None, None, "w", "b", False], "token_ids"),
    (["k", [1.0], "t", None, 1, 0, None, None, "w", "b", False], "token_ids"),
    ([7, [1], "t", None, 1, 0, None, None, "w", "b", False], "key"),
    (["k", [1], "t", 3, 1, 0, None, None, "w", "b", False], "finish_reason"),
    (["k", [1], "t", None, "1", 0, None, None, "w", "b", False], "token counts"),
    (["k", [1], "t", None, 1, 0, [[1, "x", []]], None, "w", "b", False], "logprobs"),
    (["k", [1], "t", None, 1, 0, None, [[1, -1.0, [[2]]]], "w", "b", False], "prompt_logprobs"),
    (["k", [1], "t", None, 1, 0, None, None, "w", "b", 1], "names"),
])
def test_a_malformed_delta_frame_is_refused_naming_the_field(fields, what):
    with pytest.raises(BadFrame, match=what):
        unpack_delta(msgpack.packb(fields, use_bin_type=True))


def test_bytes_that_are_not_msgpack_or_carry_binary_are_refused():
    with pytest.raises(BadFrame, match="not msgpack"):
        unpack_delta(b"\xc1\x00")
    with pytest.raises(BadFrame, match="not msgpack"):
        unpack_delta(msgpack.packb(["k", b"\x00" * 8], use_bin_type=True))


# ---- the order rule --------------------------------------------------------------------------

@pytest.mark.parametrize("taken, expected, ok", [
    (0, None, True),   # no ChannelDone yet: act on it (a death, a Serve-carried delta)
    (2, 3, False),     # a frame still on its way
    (3, 3, True),
    (4, 3, True),
])
def test_what_serve_says_waits_for_the_frames_its_channel_done_counts(taken, expected, ok):
    assert deliverable(taken, expected) is ok


class _ServeCall:
    """What the Serve call yields, then END or its error; ``gate`` holds it back until set."""

    def __init__(self, items, error=None, gate: asyncio.Event | None = None):
        self.items, self.error, self.gate = items, error, gate

    def __aiter__(self):
        async def gen():
            for item in self.items:
                yield item
            if self.gate is not None:
                await self.gate.wait()
            if self.error is not None:
                raise self.error
        return gen()


def _watched(call: _ServeCall, box: asyncio.Queue, tasks: set):
    """The call's replies in order, its watcher started as the backend starts it."""
    tasks.add(asyncio.get_running_loop().create_task(watch_call(call, box)))
    return ordered_replies(box)


async def test_frames_late_behind_serves_end_still_come_out_before_it_in_order():
    box: asyncio.Queue = asyncio.Queue()
    tasks: set = set()
    box.put_nowait((FRAME, _delta(0)))  # frames 1 and 2 arrive after Serve's ChannelDone(3) and END
    replies = _watched(_ServeCall([ChannelDone(3)]), box, tasks)
    got = [await replies.__anext__()]
    await asyncio.sleep(0)  # the watcher copies ChannelDone and END into the mailbox
    box.put_nowait((FRAME, _delta(1)))
    box.put_nowait((FRAME, _delta(2, "stop")))
    got += [d async for d in replies]
    assert [d.token_ids for d in got] == [[0], [1], [2]]


async def test_an_error_after_its_frames_is_raised_after_them():
    box: asyncio.Queue = asyncio.Queue()
    tasks: set = set()
    replies = _watched(_ServeCall([ChannelDone(2)], error=BackendFailure("engine step failed")), box, tasks)
    await asyncio.sleep(0)
    got = []
    with pytest.raises(BackendFailure, match="engine step failed"):
        for i in range(2):
            box.put_nowait((FRAME, _delta(i)))
        async for d in replies:
            got.append(d)
    assert [d.token_ids for d in got] == [[0], [1]]


async def test_a_death_without_channel_done_is_raised_at_once_though_frames_may_be_on_their_way():
    box: asyncio.Queue = asyncio.Queue()
    tasks: set = set()
    replies = _watched(_ServeCall([], error=ConnectionError("actor died")), box, tasks)
    with pytest.raises(ConnectionError, match="actor died"):
        await replies.__anext__()


async def test_deltas_serve_carries_come_after_the_channels_part():
    """The channel broke after one frame: Serve carries the rest, after ChannelDone(1)."""
    box: asyncio.Queue = asyncio.Queue()
    tasks: set = set()
    gate = asyncio.Event()
    replies = _watched(_ServeCall([ChannelDone(1), _delta(1), _delta(2, "stop")], gate=gate), box, tasks)
    for _ in range(5):
        await asyncio.sleep(0)
    box.put_nowait((FRAME, _delta(0)))
    gate.set()
    assert [d.token_ids async for d in replies] == [[0], [1], [2]]


# ---- real sockets: the challenge, sends, the inbox ----------------------------------------------

@pytest.fixture
async def inbox():
    box = TokenInbox("127.0.0.1", SECRET)
    await box.start()
    yield box
    await box.stop()


async def test_a_replica_sends_a_streams_deltas_and_tells_serve_only_how_many(inbox):
    reply_to, box = inbox.open()
    sender = TokenSender("colocated-1", SECRET)
    try:
        said = [item async for item in over_channel(sender, _request(reply_to), _deltas(3))]
        assert said == [ChannelDone(3)]
        entries = await _drain(box, 3)
        assert [(kind, d.token_ids) for kind, d in entries] == [(FRAME, [0]), (FRAME, [1]), (FRAME, [2])]
        assert entries[-1][1].finish_reason == "length"
        # a second stream reuses the connection
        reply_to2, box2 = inbox.open()
        assert [i async for i in over_channel(sender, _request(reply_to2), _deltas(1))] == [ChannelDone(1)]
        await _drain(box2, 1)
        assert inbox.counters.connections == 1 and inbox.counters.frames == 4
    finally:
        sender.close()


async def test_a_replicas_error_comes_after_a_channel_done_counting_the_frames_before_it(inbox):
    reply_to, box = inbox.open()
    sender = TokenSender("colocated-1", SECRET)
    said = []
    try:
        with pytest.raises(BackendFailure, match="boom"):
            async for item in over_channel(sender, _request(reply_to), _deltas(2, BackendFailure("boom"))):
                said.append(item)
        assert said == [ChannelDone(2)]
        assert len(await _drain(box, 2)) == 2
    finally:
        sender.close()


@pytest.mark.parametrize("secret", [bytes(32), None])
async def test_a_replica_without_the_clusters_secret_is_refused_and_its_stream_goes_through_serve(inbox, secret):
    reply_to, box = inbox.open()
    sender = TokenSender("intruder", secret)
    try:
        said = [item async for item in over_channel(sender, _request(reply_to), _deltas(2))]
        assert [d.token_ids for d in said] == [[0], [1]]  # all through Serve
        assert sender.num_fallbacks == 1 and box.empty()
        assert inbox.counters.refused == 1 and inbox.counters.connections == 0
    finally:
        sender.close()


async def test_a_replica_does_not_send_to_a_listener_that_is_not_the_inbox_named(inbox):
    reply_to, box = inbox.open()
    wrong = ReplyTo(reply_to.host, reply_to.port, "another-inbox", reply_to.key)
    sender = TokenSender("colocated-1", SECRET)
    try:
        said = [item async for item in over_channel(sender, _request(wrong), _deltas(1))]
        assert [d.token_ids for d in said] == [[0]] and box.empty()
        assert await sender.link(wrong) is None  # not retried at once
    finally:
        sender.close()


async def test_an_unreachable_inbox_costs_only_the_serve_path():
    sender = TokenSender("colocated-1", SECRET)
    nowhere = ReplyTo("127.0.0.1", 1, "inbox", "k")
    said = [item async for item in over_channel(sender, _request(nowhere), _deltas(2))]
    assert [d.token_ids for d in said] == [[0], [1]]


async def test_a_malformed_frame_closes_only_its_own_connection(inbox):
    reply_to, box = inbox.open()
    good = TokenSender("colocated-1", SECRET)
    bad = TokenSender("colocated-2", SECRET)
    try:
        link = await bad.link(reply_to)
        link._writer.write(frame(msgpack.packb(["k", "not a list"], use_bin_type=True)))
        async with asyncio.timeout(60):  # a bound for a hung inbox, not a speed: it returns at the count
            while not inbox.counters.bad_frames:
                await asyncio.sleep(0.01)
        assert inbox.counters.bad_frames == 1
        said = [item async for item in over_channel(good, _request(reply_to), _deltas(2))]
        assert said == [ChannelDone(2)] and len(await _drain(box, 2)) == 2
    finally:
        good.close()
        bad.close()


async def test_frames_for_a_closed_mailbox_are_dropped_and_counted(inbox):
    reply_to, box = inbox.open()
    inbox.close(reply_to.key)
    sender = TokenSender("colocated-1", SECRET)
    try:
        assert [i async for i in over_channel(sender, _request(reply_to), _deltas(2))] == [ChannelDone(2)]
        probe_to, probe = inbox.open()  # frames on one connection arrive in order: after the probe's, the 2 dropped
        assert [i async for i in over_channel(sender, _request(probe_to), _deltas(1))] == [ChannelDone(1)]
        await _drain(probe, 1)
        assert inbox.counters.dropped == 2 and box.empty()
    finally:
        sender.close()


# ---- the gateway's backend over a real inbox -----------------------------------------------------

class _ChannelReplica:
    """A colocated pool whose ``generate`` is a replica's: deltas over ``over_channel``."""

    def __init__(self, sender: TokenSender, n: int, error: BaseException | None = None):
        self.sender, self.n, self.error, self.requests = sender, n, error, []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req: GenerateRequest):
        self.requests.append(req)
        return _Call(over_channel(self.sender, req, _deltas(self.n, self.error)))


class _Call:
    def __init__(self, items):
        self.items, self.cancelled = items, False

    def __aiter__(self):
        return self.items

    def cancel(self):
        self.cancelled = True


def _colocated(inbox: TokenInbox, sender: TokenSender, n: int) -> tuple[ClusterBackend, _ChannelReplica]:
    """A colocated backend over ``inbox`` whose one replica streams ``n`` deltas through ``sender``."""
    replica = _ChannelReplica(sender, n)
    return ClusterBackend({"colocated": replica}, mode="colocated", model_name="m", max_model_len=64,
                          block_size=16, inbox=inbox), replica


async def test_the_backend_streams_a_request_through_its_inbox_and_closes_the_mailbox(inbox):
    sender = TokenSender("colocated-1", SECRET)
    backend, replica = _colocated(inbox, sender, 4)
    try:
        got = [d async for d in backend.generate(_request())]
        assert [d.token_ids for d in got] == [[0], [1], [2], [3]] and got[-1].finish_reason == "length"
        assert replica.requests[0].reply_to.inbox == inbox.inbox_id
        assert inbox.counters.frames == 4 and inbox.open_mailboxes == 0
    finally:
        sender.close()


async def test_a_client_that_leaves_cancels_the_call_and_closes_the_mailbox(inbox):
    sender = TokenSender("colocated-1", SECRET)
    backend, _ = _colocated(inbox, sender, 6)
    try:
        stream = backend.generate(_request())
        first = await stream.__anext__()
        await stream.aclose()
        assert first.token_ids == [0] and inbox.open_mailboxes == 0
    finally:
        sender.close()


class _QueuedCall:
    """A Serve call still waiting for a replica: its assignment is a task of this loop, as Serve's
    router makes it, and ``cancel()`` only asks that task to stop."""

    def __init__(self):
        self._replica_result_future = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    def __aiter__(self):
        async def gen():
            try:
                await self._replica_result_future
            except asyncio.CancelledError:  # as Serve's: a call cancelled before assignment
                raise RuntimeError("RequestCancelledError") from None
            yield None
        return gen()

    def cancel(self):
        self._replica_result_future.cancel()


class _HandOffPools:
    """A decode pool whose calls wait for a replica, and a prefill pool that records lease releases."""

    def __init__(self):
        self.released: list[str] = []
        self.calls: list[_QueuedCall] = []

    def __getitem__(self, pool: str):
        return self if pool in ("decode", "prefill") else None

    def __contains__(self, pool: str) -> bool:
        return pool in ("decode", "prefill")

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    @property
    def release(self):
        pools = self

        class _Release:
            @staticmethod
            def remote(message):
                pools.released.append(message.request_id)
                return FakeResponse(True)
        return _Release

    def remote(self, req):
        self.calls.append(_QueuedCall())
        return self.calls[-1]


async def test_a_hand_off_whose_decode_call_never_reached_a_replica_releases_its_lease(inbox):
    """The first token went out, the decode call waits for a replica (none is live), a deadline
    cancels it: it never ran anywhere, so the gateway releases the prefill replica's lease as soon as
    the cancelled assignment ended (the call's watcher, not the relay, awaits it)."""
    pools = _HandOffPools()
    backend = ClusterBackend(pools, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                             inbox=inbox)
    chunks = backend._decode_handoff(_request(), HANDOFF, None)
    assert (await chunks.__anext__()).token_ids == [HANDOFF.first_token_id]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):  # a deadline: the call never answers, whatever the machine's speed
            await chunks.__anext__()
    await chunks.aclose()
    await asyncio.gather(*backend._background)
    assert pools.calls[0]._replica_result_future.cancelled()
    assert pools.released == [HANDOFF.request_id] and inbox.open_mailboxes == 0


class _AssignedCall:
    """A Serve call already assigned to a replica: cancelling it asks the replica to stop, and the call
    ends when the replica's task does (``end``), with or without its generate having run."""

    def __init__(self):
        loop = asyncio.get_running_loop()
        self._replica_result_future = loop.create_future()
        self._replica_result_future.set_result(None)
        self.end = asyncio.Event()
        self.cancel_asked = False

    def __aiter__(self):
        async def gen():
            await self.end.wait()
            raise RuntimeError("the task was cancelled")  # as Serve's TaskCancelledError
            yield None
        return gen()

    def cancel(self):
        self.cancel_asked = True


async def test_a_decode_call_cancelled_on_its_replica_has_its_lease_released_once_the_call_ended(inbox):
    """A client that leaves right after the first token: the decode call already reached a replica,
    which may never run it (cancelled before it started), so its own release may never come.  The
    gateway releases the lease once the call ended there -- not before, while a pull could still read."""
    pools = _HandOffPools()
    assigned: list[_AssignedCall] = []

    def remote(req):
        assigned.append(_AssignedCall())
        return assigned[-1]
    pools.remote = remote
    backend = ClusterBackend(pools, mode="disaggregated", model_name="m", max_model_len=64, block_size=16,
                             inbox=inbox)
    chunks = backend._decode_handoff(_request(), HANDOFF, None)
    await chunks.__anext__()
    waiting = asyncio.ensure_future(chunks.__anext__())
    await asyncio.sleep(0)  # the decode call is made
    waiting.cancel()        # the client leaves
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await chunks.aclose()
    for _ in range(5):
        await asyncio.sleep(0)
    assert assigned[0].cancel_asked and pools.released == []  # the call has not ended on its replica yet
    assigned[0].end.set()
    await asyncio.gather(*backend._background)
    assert pools.released == [HANDOFF.request_id]
