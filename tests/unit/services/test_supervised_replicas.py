"""Each supervised task of a worker and of the gateway, killed through the
test hook: the worker's come back (and its health holds), the gateway's
HTTP server does not, and the gateway's check_health then raises."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdcluster.services.pools.core_lending import ThreadChooser
from pdcluster.services.pools.worker import Worker
from pdcluster.services.supervisor import SupervisedTaskDied, Supervisor


async def _yield_once(_delay: float) -> None:
    await asyncio.sleep(0)


async def _turns(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class FakeEngine:
    alive = True
    stats = SimpleNamespace()

    def check_alive(self) -> None:
        pass

    def heartbeat_age_s(self) -> float:
        return 0.0


class FakePublisher:
    async def run(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        pass


class FakeTransfer:
    def poll_notifications(self) -> list:
        return []


def bare_worker() -> Worker:
    """A Worker's background-task half, without a model or a transfer backend."""
    w = Worker.__new__(Worker)
    w.name, w.role, w._started = "prefill-7", "prefill", False
    w.config = SimpleNamespace(cluster_name="test")
    w.pool = SimpleNamespace(num_threads=1, borrow_idle_cores=True)  # a prefill replica lends/borrows cores
    w.index_url = "redis://127.0.0.1:1/0"  # nothing listens: the board task keeps retrying, as in an outage
    w.publisher, w.aengine, w.transfer = FakePublisher(), FakeEngine(), FakeTransfer()
    w.supervisor = Supervisor(w.name, sleep=_yield_once)
    w.in_flight, w.busy_flag = 0, None
    w.threads, w.engine = ThreadChooser(1, "test"), SimpleNamespace(threads_source=None)
    return w


async def test_every_worker_task_killed_is_restarted_and_health_holds(monkeypatch):
    async def gauges_forever(*_args) -> None:  # the real one returns at once outside Ray
        await asyncio.Event().wait()

    monkeypatch.setattr("pdcluster.services.pools.worker.metrics.export_gauges_forever", gauges_forever)
    w = bare_worker()
    await w.start()
    await _turns()
    names = set(w.supervisor.tasks)
    assert names == {"kv_event_publisher", "gauge_exporter", "status_board", "core_lending", "lease_notifications"}
    for name in sorted(names):
        before = w.supervisor.tasks[name].attempt
        w.supervisor.kill(name)
        await _turns()
        state = w.supervisor.tasks[name]
        assert state.crashes == 1 and not state.dead, name
        assert state.attempt is not before and not state.attempt.done(), f"{name} was not restarted"
    w.check_health()
    await w.supervisor.stop()
    assert w.engine.threads_source is w.threads and w.busy_flag is not None
    w.busy_flag.close()


async def test_the_gateways_http_server_killed_fails_its_health_check():
    from pdcluster.services.gateway.deployment import Gateway
    from pdcluster.services.gateway.http import GatewayHTTPServer
    from pdcluster.services.supervisor import RestartPolicy

    async def app(scope, receive, send):  # never reached
        raise AssertionError

    gw = Gateway.__new__(Gateway)
    gw.supervisor = Supervisor("gateway", sleep=_yield_once)
    gw.http = GatewayHTTPServer(app, "127.0.0.1", 0)
    gw.supervisor.start("http_server", gw.http.serve, RestartPolicy(restart=False))
    await _turns()
    gw.check_health()
    gw.supervisor.kill("http_server")
    await _turns()
    with pytest.raises(SupervisedTaskDied, match="http_server"):
        gw.check_health()
    await gw.supervisor.stop()
    gw.http._socket.close()
