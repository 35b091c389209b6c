"""/live (the process serves) and /ready (a request sent now succeeds), open
without an API key like /health (pdcluster/services/openai/probes.py)."""

from __future__ import annotations

import httpx
from openai_fakes import FakeBackend, make_app

from pdcluster.services.config import api_key_digest


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


async def test_live_stays_up_while_ready_follows_the_backend(tokenizer):
    backend = FakeBackend()
    async with client_of(make_app(backend, tokenizer)) as c:
        assert (await c.get("/ready")).status_code == 200
        backend.health_status = {"status": "unavailable", "reason": "no live replica in the decode pool(s) yet"}
        r = await c.get("/ready")
        assert r.status_code == 503 and "decode" in r.json()["reason"]
        live = await c.get("/live")
        assert live.status_code == 200 and live.json() == {"status": "alive"}
        assert (await c.get("/health")).status_code == 503   # /health keeps its meaning


async def test_probes_need_no_api_key(tokenizer):
    app = make_app(FakeBackend(), tokenizer, api_key_digests=(api_key_digest("sk-probe-test-0123456789abcdef"),))
    async with client_of(app) as c:
        assert (await c.get("/live")).status_code == 200
        assert (await c.get("/ready")).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
