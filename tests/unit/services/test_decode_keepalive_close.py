"""A decode call whose gateway leaves while the reservation waits in line for
KV leaks nothing (pools/decode.py): also when the reservation is made while
the call's keep-alive is out, so the generator closes at that yield with the
reservation already taken (seen in `make test`: a decode replica kept one
request in awaiting_kv, 3 blocks held, after a reject_decode hand-off).
The engine is a fake that records aborts; the real path runs in
tests/integration/faults/test_deadlines.py and test_leases.py."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from pdcluster.router.routing_header import RoutingHeader
from pdcluster.services.config import ClusterConfig
from pdcluster.services.sampling_params import greedy
from pdcluster.services.messages import GenerateRequest, PrefillResponse
from pdcluster.services.pools.decode import DecodeServer


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


class _Worker:
    name = "decode-test"
    transfer = SimpleNamespace(name="socket")
    sender = None  # no token channel: the deltas go through Serve

    def __init__(self) -> None:
        self.aengine = _Engine()

    @contextlib.contextmanager
    def admitted(self, capacity: int):
        yield


def _server(reserve_s: float, outcome) -> DecodeServer:
    server = object.__new__(DecodeServer)  # no Ray, no engine: the generate() logic alone
    server.cfg, server.waiting_every_s = ClusterConfig(), 0.01
    server.worker, server._background, server._rejected_once = _Worker(), set(), set()

    async def reserve(req):
        await asyncio.sleep(reserve_s)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    server._reserve = reserve
    return server


def _request() -> GenerateRequest:
    handoff = PrefillResponse("r1", 7, "x", None, (), 3, 0, b"", "prefill-test", 0.01)  # no remote blocks
    return GenerateRequest("r1", [1, 2, 3], greedy(4), RoutingHeader((), 3), handoff=handoff)


async def test_a_reservation_made_while_the_keep_alive_was_out_goes_back():
    server = _server(0.05, SimpleNamespace(num_cached_blocks=0, missing_block_ids=[4]))
    stream = server.generate(_request())
    first = await stream.__anext__()
    assert first.waiting  # a keep-alive: the reservation is still in line
    await asyncio.sleep(0.2)  # it is made meanwhile, while nobody reads the stream
    await stream.aclose()     # the gateway leaves at the keep-alive
    assert server.worker.aengine.aborted == ["r1"]


async def test_a_reservation_still_in_line_is_cancelled_and_aborts_nothing():
    server = _server(30.0, SimpleNamespace(num_cached_blocks=0, missing_block_ids=[4]))
    stream = server.generate(_request())
    assert (await stream.__anext__()).waiting
    await stream.aclose()
    assert server.worker.aengine.aborted == []  # never made: the cancelled command undoes itself
