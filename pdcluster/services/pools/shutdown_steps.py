"""A replica's shutdown as named steps, each timed and bounded.

Serve gives a stopping replica ``graceful_shutdown_timeout_s`` (the config's
``shutdown_timeout_s``, 30 s) and then kills it.  In the integration suite a
decode replica now and then used all of it after serving its last request
(Serve's controller: "did not shut down after grace period, force-killing
it"), 30 s per cluster stop, with no word on which part of the shutdown
waited.  Here each step runs under its own bound:

    step(name)  = await the coroutine, or run the blocking call on a daemon thread
    bounded by  = step_timeout_s; past it the step is left behind (a daemon thread
                  does not hold the process) and the next step runs
    reported    = every step slower than SLOW_STEP_S, on Serve's replica log

so a stuck step costs its bound, not the grace period, and the replica log
names it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SLOW_STEP_S = 1.0
# Serve writes this logger to the replica's own log (logs/serve/replica_*.log); the product's
# loggers are not captured there.
serve_log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class StepTime:
    name: str
    seconds: float
    finished: bool          # False: left running past its bound
    error: str | None = None


async def _on_daemon_thread(fn: Callable[[], Any]) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(how: Callable[[], Any]) -> None:
        try:
            loop.call_soon_threadsafe(how)
        except RuntimeError:  # left behind, and the loop has closed since: nobody waits
            pass

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting step
            settle(lambda err=exc: done.done() or done.set_exception(err))
        else:
            settle(lambda: done.done() or done.set_result(None))

    threading.Thread(target=run, name="replica-shutdown-step", daemon=True).start()
    await done


async def run_step(name: str, step: Callable[[], Any], timeout_s: float) -> StepTime:
    """Runs one step (a coroutine function or a blocking call) within ``timeout_s``; never raises
    but CancelledError."""
    started = time.monotonic()
    finished, error = True, None
    try:
        work = step() if inspect.iscoroutinefunction(step) else _on_daemon_thread(step)
        await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        finished = False
    except Exception as exc:  # noqa: BLE001 - one failed step must not skip the others
        error = repr(exc)
    return StepTime(name, time.monotonic() - started, finished, error)


async def run_steps(owner: str, steps: list[tuple[str, Callable[[], Any]]], timeout_s: float) -> list[StepTime]:
    """The steps in order, each bounded; the slow, unfinished or failed ones reported."""
    times = []
    for name, step in steps:
        t = await run_step(name, step, timeout_s)
        times.append(t)
        if not t.finished:
            serve_log.warning("%s: shutdown step %s still running after %.1f s; going on without it",
                              owner, name, t.seconds)
        elif t.error is not None:
            serve_log.warning("%s: shutdown step %s failed after %.1f s: %s", owner, name, t.seconds, t.error)
        elif t.seconds > SLOW_STEP_S:
            serve_log.warning("%s: shutdown step %s took %.1f s", owner, name, t.seconds)
    return times
