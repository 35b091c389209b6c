"""Draining (pdcluster/services/openai/drain.py): once started, new requests get 503
with Retry-After and /ready fails, while requests already in flight run to
their end; wait_idle returns when the last one finishes, or at its timeout."""

from __future__ import annotations

import asyncio

import httpx
from openai_fakes import FakeBackend, make_app

from pdcluster.services.openai.drain import Drain, DrainGate


class HeldApp:
    """An ASGI app whose /work requests answer only once ``release`` is set."""

    def __init__(self) -> None:
        self.state = type("State", (), {})()
        self.state.drain = Drain()
        self.release, self.entered = asyncio.Event(), asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] == "/work":
            self.entered.set()
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})


def gated_client(app: HeldApp) -> httpx.AsyncClient:
    gate = DrainGate(app)

    async def with_app(scope, receive, send):
        await gate({**scope, "app": app}, receive, send)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=with_app), base_url="http://gateway")


async def test_in_flight_requests_finish_and_new_ones_are_refused():
    app = HeldApp()
    drain = app.state.drain
    async with gated_client(app) as c:
        held = asyncio.create_task(c.get("/work"))
        await asyncio.wait_for(app.entered.wait(), 30)
        assert drain.in_flight == 1
        waiting = asyncio.create_task(drain.wait_idle(timeout_s=60))
        await asyncio.sleep(0)
        assert drain.draining and not waiting.done()
        refused = await c.get("/work")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "draining"
        assert (await c.get("/metrics")).status_code == 200   # scrapes and probes stay open
        app.release.set()
        assert (await held).status_code == 200 and (await held).text == "done"
        result = await asyncio.wait_for(waiting, 30)
    assert result["drained"] and result["in_flight"] == 0


async def test_wait_idle_gives_up_at_the_timeout():
    drain = Drain()
    drain.enter()
    result = await drain.wait_idle(timeout_s=0.05)
    assert result == {"drained": False, "in_flight": 1, "waited_s": result["waited_s"]}
    assert (await Drain().wait_idle(timeout_s=0))["drained"]   # nothing in flight: at once


async def test_the_app_fails_ready_while_draining_and_stays_live(tokenizer):
    app = make_app(FakeBackend(), tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert (await c.get("/ready")).status_code == 200
        app.state.drain.start()
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        assert (await c.get("/live")).status_code == 200
        new = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert new.status_code == 503 and "retry-after" in new.headers


def test_up_says_how_the_drain_went():
    from pdcluster.services.cli.up import drain_summary

    assert "finished in 1.5 s" in drain_summary({"drained": True, "in_flight": 0, "waited_s": 1.5})
    assert "2 request(s) still in flight" in drain_summary({"drained": False, "in_flight": 2, "waited_s": 30})
    assert "could not drain (RayServeException: gone)" in drain_summary({"drained": False,
                                                                         "error": "RayServeException: gone"})
