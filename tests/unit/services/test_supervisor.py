"""Supervised background tasks: a crash (or the kill hook) is logged, counted
and restarted with backoff, or fails the owner's health; no real sleeps."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdcluster.services.supervisor import RestartPolicy, SupervisedTaskDied, Supervisor, backoff_s, gives_up


class Recorder:
    """A fake sleep: records each backoff, yields once, never waits."""

    def __init__(self):
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


async def settle(sup: Supervisor, name: str, attempts: int) -> None:
    """Runs the loop until ``name`` has made ``attempts`` attempts or died (a bound on turns, not time)."""
    for _ in range(1000):
        state = sup.tasks[name]
        if state.dead or (state.crashes + 1 >= attempts and state.attempt is not None
                          and not state.attempt.done()):
            await asyncio.sleep(0)  # the fresh attempt runs up to its first await
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{name} did not settle: {sup.tasks[name]}")


def forever_factory(starts: list[int]):
    async def run() -> None:
        starts.append(1)
        await asyncio.Event().wait()
    return run


def test_backoff_doubles_and_is_capped_and_giving_up_follows_the_policy():
    p = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0, max_crashes=3)
    assert [backoff_s(p, n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert not gives_up(p, 2) and gives_up(p, 3)
    assert gives_up(RestartPolicy(restart=False), 1)
    with pytest.raises(ValueError, match="max_crashes"):
        RestartPolicy(max_crashes=0)


async def test_a_raising_task_is_logged_counted_and_restarted_with_backoff(caplog):
    sleep, starts = Recorder(), []

    async def flaky() -> None:
        starts.append(1)
        if len(starts) <= 2:
            raise ConnectionError("redis went away")
        await asyncio.Event().wait()

    sup = Supervisor("prefill-1", sleep=sleep)
    with caplog.at_level(logging.WARNING, logger="pdcluster.supervisor"):
        sup.start("status_board", flaky, RestartPolicy(initial_backoff_s=0.5))
        await settle(sup, "status_board", 3)
    assert len(starts) == 3 and sleep.delays == [0.5, 1.0]
    assert sup.crash_counts() == {"status_board": 2}
    assert sup.tasks["status_board"].last_error == "ConnectionError: redis went away"
    assert "background task status_board raised" in caplog.text and "restart 2" in caplog.text
    sup.check_health()  # restarted: healthy
    await sup.stop()


async def test_the_kill_hook_crashes_a_running_task_and_it_comes_back(caplog):
    sleep, starts = Recorder(), []
    sup = Supervisor("decode-1", sleep=sleep)
    sup.start("lease_notifications", forever_factory(starts))
    await settle(sup, "lease_notifications", 1)
    with caplog.at_level(logging.WARNING, logger="pdcluster.supervisor"):
        sup.kill("lease_notifications")
        await settle(sup, "lease_notifications", 2)
    assert len(starts) == 2 and sup.crash_counts() == {"lease_notifications": 1}
    assert "killed by the test hook" in caplog.text
    sup.check_health()
    await sup.stop()


async def test_a_task_that_must_not_restart_fails_health_naming_it():
    sup = Supervisor("gateway", sleep=Recorder())
    sup.start("http_server", forever_factory([]), RestartPolicy(restart=False))
    await settle(sup, "http_server", 1)
    sup.check_health()
    sup.kill("http_server")
    await settle(sup, "http_server", 2)
    assert sup.tasks["http_server"].dead
    with pytest.raises(SupervisedTaskDied, match="http_server"):
        sup.check_health()
    await sup.stop()


async def test_too_many_crashes_in_a_row_and_a_plain_return_are_deaths():
    async def broken() -> None:
        raise ValueError("bad config")

    async def returns() -> None:
        return None

    sleep = Recorder()
    sup = Supervisor("prefill-2", sleep=sleep)
    sup.start("gauge_exporter", broken, RestartPolicy(max_crashes=3))
    sup.start("kv_event_publisher", returns, RestartPolicy(max_crashes=1))
    await settle(sup, "gauge_exporter", 4)
    await settle(sup, "kv_event_publisher", 2)
    assert sup.crash_counts() == {"gauge_exporter": 3, "kv_event_publisher": 1}
    with pytest.raises(SupervisedTaskDied, match=r"gauge_exporter \(ValueError: bad config, 3 crash\(es\)\)"):
        sup.check_health()
    assert sup.tasks["kv_event_publisher"].last_error == "returned"
    await sup.stop()


async def test_a_task_that_may_return_ends_quietly_and_stop_is_no_crash():
    async def done() -> None:
        return None

    sup = Supervisor("prefill-3", sleep=Recorder())
    sup.start("kv_event_publisher", done, RestartPolicy(may_return=True))
    sup.start("status_board", forever_factory([]))
    await settle(sup, "status_board", 1)
    for _ in range(5):
        await asyncio.sleep(0)
    await sup.stop()
    assert sup.crash_counts() == {"kv_event_publisher": 0, "status_board": 0}
    sup.check_health()


async def test_a_name_is_supervised_once():
    sup = Supervisor("x")
    sup.start("a", forever_factory([]))
    with pytest.raises(ValueError, match="already supervised"):
        sup.start("a", forever_factory([]))
    await sup.stop()
