"""Reservations wait in line on the engine thread, not in a poll loop on the
event loop (issue 33): oldest first, a caller that left is skipped and a
reservation made as it left is undone, and the engine's death reaches every
waiter.  The line alone, then through AsyncEngine with a stand-in engine
whose pool has a fixed number of blocks."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import EngineDeadError, InvalidRequestError
from pdcluster.services.engine.reservation_line import ReservationLine


class Pool:
    def __init__(self, free: int):
        self.free, self.attempts, self.undone = free, [], []

    def attempt(self, name: str, need: int):
        def run():
            self.attempts.append(name)
            if need > self.free:
                return None
            self.free -= need
            return (name, need)
        return run

    def undo(self, result):
        self.undone.append(result)
        self.free += result[1]


def test_the_line_serves_oldest_first_and_a_large_one_is_not_overtaken():
    pool, line = Pool(2), ReservationLine()
    big, small = concurrent.futures.Future(), concurrent.futures.Future()
    line.offer(pool.attempt("big", 4), big, pool.undo)
    line.offer(pool.attempt("small", 1), small, pool.undo)   # would fit, but waits behind big
    assert len(line) == 2 and pool.attempts == ["big"] and not small.done()
    pool.free = 5
    assert line.serve() == 2 and big.result() == ("big", 4) and small.result() == ("small", 1)
    assert len(line) == 0


def test_a_caller_that_left_is_skipped_and_a_late_reservation_is_undone():
    pool, line = Pool(0), ReservationLine()
    gone, next_one = concurrent.futures.Future(), concurrent.futures.Future()
    line.offer(pool.attempt("gone", 1), gone, pool.undo)
    line.offer(pool.attempt("next", 1), next_one, pool.undo)
    gone.cancel()
    pool.free = 1
    assert line.serve() == 2 and pool.attempts == ["gone", "next"] and next_one.result() == ("next", 1)

    late = concurrent.futures.Future()
    line.offer(lambda: (late.cancel(), ("late", 1))[1], late, pool.undo)  # it leaves as it is served
    assert pool.undone == [("late", 1)]


def test_an_error_goes_to_its_caller_and_death_to_everyone_waiting():
    pool, line = Pool(0), ReservationLine()
    bad = concurrent.futures.Future()

    def raises():
        raise InvalidRequestError("prompt too long")

    line.offer(raises, bad, pool.undo)
    with pytest.raises(InvalidRequestError):
        bad.result()
    waiting = [concurrent.futures.Future() for _ in range(3)]
    for i, f in enumerate(waiting):
        line.offer(pool.attempt(f"w{i}", 1), f, pool.undo)
    line.fail_all(EngineDeadError("gone"))
    assert all(isinstance(f.exception(), EngineDeadError) for f in waiting) and len(line) == 0


class BlocksEngine:
    """What AsyncEngine calls, over a pool of ``free`` blocks: a reservation takes
    ``len(prompt)`` blocks or returns None; abort gives them back."""

    def __init__(self, free: int):
        self.free, self.awaiting_kv, self.requests, self.attempts = free, {}, {}, 0

    def reserve_external(self, request_id, prompt, params, ttl_s, block_hashes):
        self.attempts += 1
        if len(prompt) > self.free:
            return None
        self.free -= len(prompt)
        self.awaiting_kv[request_id] = len(prompt)
        from pdcluster.services.engine.outputs import ExternalKVAllocation
        return ExternalKVAllocation(request_id, tuple(range(len(prompt))), 0)

    def abort(self, request_id):
        self.free += self.awaiting_kv.pop(request_id, 0)
        return True

    def has_unfinished(self):
        return False

    def expire_stale(self):
        pass

    def stats(self):
        return None


async def test_a_reservation_waits_for_blocks_and_gets_them_when_an_abort_frees_them():
    engine = BlocksEngine(free=4)
    aeng = AsyncEngine(engine)
    aeng._abort_reservation = lambda alloc: engine.abort(alloc.request_id)  # stand-in engine: no Request objects
    try:
        first = await aeng.reserve_external("a", [1, 2, 3], None, wait_s=5)
        assert first is not None and engine.free == 1
        waiting = asyncio.ensure_future(aeng.reserve_external("b", [1, 2], None, wait_s=60))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await aeng.abort("a")          # frees 3 blocks: the line is served at the loop's next turn
        got = await asyncio.wait_for(waiting, 30)
        assert got.request_id == "b" and engine.free == 2
        assert await aeng.reserve_external("c", [1, 2, 3], None, wait_s=0.2) is None  # never fits: None at the end
        assert len(aeng._line) <= 1    # it left the line (dropped at the loop's next turn)
    finally:
        await aeng.shutdown()


async def test_a_caller_that_gives_up_leaves_nothing_reserved():
    engine = BlocksEngine(free=0)
    aeng = AsyncEngine(engine)
    aeng._abort_reservation = lambda alloc: engine.abort(alloc.request_id)
    try:
        waiting = asyncio.ensure_future(aeng.reserve_external("x", [1], None, wait_s=60))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        engine.free = 1                # blocks come free after the caller left
        await aeng.abort("nothing")    # a command: the loop turns and serves the line
        await aeng.run(lambda e: None)
        assert engine.free == 1 and engine.awaiting_kv == {}
    finally:
        await aeng.shutdown()
