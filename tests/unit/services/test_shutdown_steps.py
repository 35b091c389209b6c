"""A replica's shutdown steps (pdcluster/services/pools/shutdown_steps.py): each runs,
in order; one that blocks past its bound is left behind and named, one that fails
does not skip the rest.  Nothing here rests on timing: the stuck steps wait on events
the test never sets, the steps that finish under the short bound are coroutines that
return without suspending (asyncio.wait_for runs them before its timer can fire, however
loaded the machine), and blocking steps that finish get a bound they never need."""

from __future__ import annotations

import asyncio
import logging
import threading

from pdcluster.services.pools.shutdown_steps import run_steps


async def test_a_stuck_step_is_left_behind_named_and_the_rest_still_run(caplog):
    ran: list[str] = []
    never = threading.Event()
    forever = asyncio.Event()

    async def supervisor() -> None:
        ran.append("supervisor")

    def stuck_transfer() -> None:     # a blocking close that never returns
        never.wait()

    async def stuck_publisher() -> None:
        await forever.wait()

    async def failing() -> None:
        raise RuntimeError("gone already")

    async def engine() -> None:
        ran.append("engine")

    try:
        with caplog.at_level(logging.WARNING, logger="ray.serve"):
            times = await run_steps("decode-1", [("supervisor", supervisor), ("transfer", stuck_transfer),
                                                 ("publisher", stuck_publisher), ("flag", failing),
                                                 ("engine", engine)], timeout_s=0.2)
    finally:
        never.set()
    assert ran == ["supervisor", "engine"]
    assert [(t.name, t.finished, t.error is not None) for t in times] == [
        ("supervisor", True, False), ("transfer", False, False), ("publisher", False, False),
        ("flag", True, True), ("engine", True, False)]
    logged = caplog.text
    assert "decode-1: shutdown step transfer still running" in logged
    assert "decode-1: shutdown step publisher still running" in logged
    assert "shutdown step flag failed" in logged and "gone already" in logged
    assert "shutdown step supervisor" not in logged


async def test_a_blocking_step_runs_off_the_event_loop_and_its_failure_is_named(caplog):
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def refuses() -> None:
        raise OSError("already closed")

    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        times = await run_steps("w", [("close", lambda: seen.append(threading.get_ident())),
                                      ("flag", refuses)], timeout_s=300)
    assert seen and seen[0] != loop_thread
    assert [(t.name, t.finished, t.error) for t in times] == [("close", True, None),
                                                              ("flag", True, "OSError('already closed')")]
    assert "w: shutdown step flag failed" in caplog.text
