"""Long-lived background tasks of a replica, supervised: none dies silently.

A task is a coroutine factory run on the replica's event loop.  When an
attempt ends by an exception (or returns, or is killed through ``kill``,
the test hook), the supervisor logs it with the task's name, counts it
(``pdcluster_task_crashes``), and then, by the task's policy::

    restart=True    sleeps backoff_s(crashes) and runs a fresh attempt;
                    after max_crashes in a row without max_healthy_s of
                    running in between, gives up: the task is dead
    restart=False   the task is dead at once

A dead task makes ``check_health`` raise ``SupervisedTaskDied`` (Serve
then replaces the replica).  Only ``stop`` (or ``expect_end`` before an owner's own graceful stop) ends
tasks quietly.

    start ──► running ──exception──► crashed ──backoff──► running ...
                 │                      └──(no restart | too many)──► dead: check_health raises
                 └──stop──► stopped
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pdcluster.observability import metrics

log = logging.getLogger("pdcluster.supervisor")

TaskFactory = Callable[[], Awaitable[None]]


class SupervisedTaskDied(RuntimeError):
    """A background task the replica needs has stopped for good."""


@dataclass(frozen=True)
class RestartPolicy:
    restart: bool = True
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    max_crashes: int = 10        # in a row; then the task is dead
    max_healthy_s: float = 60.0  # an attempt running this long resets the count
    may_return: bool = False     # a return is the task's own decision to end (not a crash)

    def __post_init__(self) -> None:
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("backoff must satisfy 0 <= initial_backoff_s <= max_backoff_s")
        if self.max_crashes < 1:
            raise ValueError(f"max_crashes must be >= 1, got {self.max_crashes}")


def backoff_s(policy: RestartPolicy, crashes_in_a_row: int) -> float:
    """Seconds before the next attempt: doubling from the first crash, capped."""
    return min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** max(0, crashes_in_a_row - 1))


def gives_up(policy: RestartPolicy, crashes_in_a_row: int) -> bool:
    return not policy.restart or crashes_in_a_row >= policy.max_crashes


@dataclass
class TaskState:
    name: str
    policy: RestartPolicy
    crashes: int = 0            # all of them
    crashes_in_a_row: int = 0
    last_error: str | None = None
    dead: bool = False
    attempt: asyncio.Task | None = field(default=None, repr=False)
    killed: bool = field(default=False, repr=False)
    ending: bool = False  # its owner is stopping it: a return is not a crash


class Supervisor:
    """The background tasks of one owner (a replica); one event loop."""

    def __init__(self, owner: str, *, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.owner = owner
        self.tasks: dict[str, TaskState] = {}
        self._loops: dict[str, asyncio.Task] = {}
        self._sleep, self._clock = sleep, clock

    def start(self, name: str, factory: TaskFactory, policy: RestartPolicy = RestartPolicy()) -> None:
        if name in self.tasks:
            raise ValueError(f"a task named {name!r} is already supervised in {self.owner}")
        state = self.tasks[name] = TaskState(name, policy)
        self._loops[name] = asyncio.get_running_loop().create_task(self._supervise(state, factory),
                                                                   name=f"{self.owner}:{name}")

    async def _supervise(self, state: TaskState, factory: TaskFactory) -> None:
        while True:
            began = self._clock()
            state.attempt = asyncio.ensure_future(factory())
            try:
                await state.attempt
                if state.ending or state.policy.may_return:
                    log.info("%s: background task %s ended", self.owner, state.name)
                    return
                error = "returned"  # a long-lived task must not end by itself
            except asyncio.CancelledError:
                if not state.killed:
                    raise  # stop(): ours to end
                error = "killed by the test hook"
            except Exception as exc:  # noqa: BLE001 - the point: nothing dies unseen
                error = f"{type(exc).__name__}: {exc}"
                log.error("%s: background task %s raised", self.owner, state.name, exc_info=exc)
            state.killed = False
            if self._clock() - began >= state.policy.max_healthy_s:
                state.crashes_in_a_row = 0
            state.crashes += 1
            state.crashes_in_a_row += 1
            state.last_error = error
            metrics.count_task_crash(state.name)
            if gives_up(state.policy, state.crashes_in_a_row):
                state.dead = True
                log.error("%s: background task %s is dead after %d crash(es) (%s); health checks fail",
                          self.owner, state.name, state.crashes_in_a_row, error)
                return
            delay = backoff_s(state.policy, state.crashes_in_a_row)
            log.warning("%s: background task %s stopped (%s); restart %d in %.1f s",
                        self.owner, state.name, error, state.crashes, delay)
            await self._sleep(delay)

    def kill(self, name: str) -> None:
        """Test hook: ends the task's running attempt as a crash would."""
        state = self.tasks[name]
        if state.attempt is None or state.attempt.done():
            raise RuntimeError(f"task {name!r} of {self.owner} has no running attempt to kill")
        state.killed = True
        state.attempt.cancel()

    def expect_end(self, name: str) -> None:
        """The owner is ending this task its own way (e.g. a graceful server stop)."""
        self.tasks[name].ending = True

    def check_health(self) -> None:
        dead = [s for s in self.tasks.values() if s.dead]
        if dead:
            raise SupervisedTaskDied(f"{self.owner}: background task(s) stopped for good: " + "; ".join(
                f"{s.name} ({s.last_error}, {s.crashes} crash(es))" for s in dead) +
                ": see this replica's log; Serve replaces it")

    def crash_counts(self) -> dict[str, int]:
        return {name: s.crashes for name, s in self.tasks.items()}

    async def stop(self) -> None:
        for name, loop in self._loops.items():
            loop.cancel()
            attempt = self.tasks[name].attempt
            if attempt is not None:
                attempt.cancel()
        await asyncio.gather(*self._loops.values(), *(s.attempt for s in self.tasks.values() if s.attempt),
                             return_exceptions=True)
        self._loops.clear()
