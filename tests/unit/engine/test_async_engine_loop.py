"""The engine loop's own robustness, on a stand-in engine (no model):
cancelled commands, the heartbeat, injected faults, and what every waiter
hears when the loop is gone."""

import asyncio
import time

import pytest

from pdcluster.services.engine.async_engine import AsyncEngine
from pdcluster.services.engine_errors import EngineDeadError, RequestFailedError
from pdcluster.services.engine.outputs import RequestOutput
from pdcluster.services.engine.request import FinishReason


class FakeEngine:
    """Just what AsyncEngine calls; each step finishes the oldest request,
    or fails it if its id starts with "fail"."""

    def __init__(self):
        self.pending: list[str] = []
        self.requests: dict = {}
        self.awaiting_kv: dict = {}
        self.step_error: BaseException | None = None

    def add_request(self, request_id, prompt, params, prefill_only=False):
        self.pending.append(request_id)
        return request_id

    def abort(self, request_id):
        if request_id in self.pending:
            self.pending.remove(request_id)
            return True
        return False

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        time.sleep(0.002)
        if self.step_error is not None:
            raise self.step_error
        rid = self.pending.pop(0)
        error = "numerical error in this request's logits" if rid.startswith("fail") else None
        return [RequestOutput(rid, [1], "x", True, FinishReason.ABORT if error else FinishReason.LENGTH, error=error)]

    def expire_stale(self):
        pass

    def stats(self):
        return None


async def collect(aeng, rid):
    return [o async for o in aeng.generate(rid, [1], None)]


async def test_a_command_cancelled_before_it_ran_is_skipped_and_the_loop_lives():
    aeng = AsyncEngine(FakeEngine())
    ran = []
    try:
        aeng.inject_fault("stall", 0.3)
        await asyncio.sleep(0.05)  # the loop is asleep in the stall now
        task = asyncio.create_task(aeng.run(lambda e: ran.append("late")))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await aeng.run(lambda e: "next") == "next"  # answered once the stall is over
        assert ran == [] and aeng.alive
    finally:
        await aeng.shutdown()


async def test_a_failed_request_raises_in_its_own_stream_only():
    aeng = AsyncEngine(FakeEngine())
    try:
        ok, failed = await asyncio.gather(collect(aeng, "ok"), collect(aeng, "fail-1"), return_exceptions=True)
        assert [o.finish_reason for o in ok] == [FinishReason.LENGTH]
        assert isinstance(failed, RequestFailedError) and "numerical error" in str(failed)
        assert aeng.alive and len(await collect(aeng, "after")) == 1
    finally:
        await aeng.shutdown()


async def _eventually(check, timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_heartbeat_is_fresh_when_idle_and_stale_while_stalled():
    aeng = AsyncEngine(FakeEngine())
    try:
        # The idle loop wakes every 50 ms: its heartbeat freshens (polled, so a busy machine only waits longer).
        assert await _eventually(lambda: aeng.heartbeat_age_s() < 0.3)
        aeng.inject_fault("stall", 2.0)
        await asyncio.sleep(1.2)
        assert aeng.heartbeat_age_s() > 0.5 and aeng.alive  # at least 1.2 s since the last beat
        assert await _eventually(lambda: aeng.heartbeat_age_s() < 0.3)
    finally:
        await aeng.shutdown()


async def test_kill_ends_every_waiter_and_every_later_call():
    engine = FakeEngine()
    aeng = AsyncEngine(engine)
    engine.step = lambda: time.sleep(0.002) or []  # requests never finish
    stream = asyncio.create_task(collect(aeng, "r"))
    await asyncio.sleep(0.05)
    aeng.inject_fault("kill")
    with pytest.raises(EngineDeadError, match="inject_fault"):
        await stream
    assert not aeng.alive
    with pytest.raises(EngineDeadError, match="engine loop died: InjectedFault"):
        aeng.check_alive()
    with pytest.raises(EngineDeadError):
        await aeng.run(lambda e: None)
    with pytest.raises(EngineDeadError):
        await collect(aeng, "later")


async def test_an_engine_that_gives_up_takes_the_loop_down_with_its_cause():
    engine = FakeEngine()
    engine.step_error = EngineDeadError("3 engine steps in a row failed")
    aeng = AsyncEngine(engine)
    with pytest.raises(EngineDeadError, match="3 engine steps in a row failed"):
        await collect(aeng, "r")
    assert not aeng.alive


async def test_shutdown_answers_what_was_still_waiting():
    aeng = AsyncEngine(FakeEngine())
    await aeng.shutdown()
    assert not aeng.alive
    with pytest.raises(EngineDeadError, match="shut down"):
        aeng.check_alive()


def test_inject_fault_refuses_unknown_kinds():
    aeng = AsyncEngine(FakeEngine())
    try:
        with pytest.raises(ValueError, match="fault kind must be one of"):
            aeng.inject_fault("explode")
        with pytest.raises(ValueError, match="seconds must be a finite number"):
            aeng.inject_fault("stall", float("nan"))
    finally:
        asyncio.run(aeng.shutdown())
