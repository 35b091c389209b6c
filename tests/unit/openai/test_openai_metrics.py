"""The gateway's GET /metrics (pdcluster/services/openai/gateway_metrics.py): Prometheus
text that parses, request counts by endpoint and status class, the client's
TTFT/TPOT/E2E, admission counters, and replica KV numbers from the status
board (a fake, and once the real Redis board that replicas publish to)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from openai_fakes import CHAT, MODEL, FakeBackend, make_app
from prometheus_client.parser import text_string_to_metric_families

from pdcluster.services.gateway.admission import Admission
from pdcluster.services.backend import BackendOverloaded
from pdcluster.services.messages import TokenDelta
from pdcluster.services.config import api_key_digest
from pdcluster.services.openai import configure_app, create_app
from pdcluster.services.openai.gateway_metrics import GatewayMetrics
from pdcluster.services.openai.replica_board import StatusBoardReader
from pdcluster.services.openai.settings import OpenAISettings


def parse(text: str) -> dict[str, list]:
    """name -> its samples, as prometheus_client's own parser reads them."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    hits = [s.value for samples in families.values() for s in samples
            if s.name == sample_name and s.labels == labels]
    assert len(hits) == 1, (sample_name, labels, hits)
    return hits[0]


async def scrape(c: httpx.AsyncClient, **headers: str) -> dict[str, list]:
    r = await c.get("/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                             base_url="http://gateway")


def app_with(backend: FakeBackend, tokenizer, metrics: GatewayMetrics, **settings):
    app = create_app()
    configure_app(app, backend, tokenizer, OpenAISettings(served_model_names=(MODEL,), block_hash_seed=1,
                                                          **settings), metrics)
    return app


async def test_requests_are_counted_and_timed_after_they_run(client):
    before = await scrape(client)
    assert "pdcluster_ttft_seconds" in before and value(before, "pdcluster_ttft_seconds_count") == 0
    assert (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})).status_code == 200
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
    assert r.status_code == 200
    families = await scrape(client)
    assert value(families, "pdcluster_http_responses_total", endpoint="/v1/completions", status_class="2xx") == 1
    assert value(families, "pdcluster_http_responses_total", endpoint="/v1/chat/completions",
                 status_class="2xx") == 1
    assert value(families, "pdcluster_http_responses_total", endpoint="/metrics", status_class="2xx") == 1
    for name in ("pdcluster_ttft_seconds", "pdcluster_tpot_seconds", "pdcluster_e2e_seconds"):
        assert value(families, f"{name}_count") == 2, name
        assert value(families, f"{name}_bucket", le="+Inf") == 2
        assert value(families, f"{name}_sum") > 0
    assert value(families, "pdcluster_generation_tokens_total") == 3 + 4


async def test_status_classes_and_endpoint_labels(client, backend):
    await client.post("/v1/completions", json={"prompt": 5})
    await client.get("/v1/models/gpt-4")
    await client.get(f"/v1/models/{MODEL}")
    await client.get("/no/such/path/123")
    await client.post("/tokenize", json={"prompt": "Hi"})
    backend.script.raise_before = BackendOverloaded("busy")
    await client.post("/v1/completions", json={"prompt": "Hi"})
    families = await scrape(client)
    counted = {(s.labels["endpoint"], s.labels["status_class"]): s.value
               for s in families["pdcluster_http_responses"] if s.name.endswith("_total")}
    assert counted == {("/v1/completions", "4xx"): 1, ("/v1/models/{model_id}", "4xx"): 1,
                       ("/v1/models/{model_id}", "2xx"): 1, ("other", "4xx"): 1, ("/tokenize", "2xx"): 1,
                       ("/v1/completions", "429"): 1}


async def test_an_unhandled_error_counts_as_5xx(backend, tokenizer):
    backend.script.raise_before = RuntimeError("a bug")   # type: ignore[assignment]
    async with client_of(make_app(backend, tokenizer)) as c:
        assert (await c.post("/v1/completions", json={"prompt": "Hi"})).status_code == 500
        families = await scrape(c)
    assert value(families, "pdcluster_http_responses_total", endpoint="/v1/completions", status_class="5xx") == 1


async def test_refusals_without_a_key_are_counted(backend, tokenizer):
    key = "sk-test-metrics-0123456789abcdef"
    async with client_of(make_app(backend, tokenizer, api_key_digests=(api_key_digest(key),))) as c:
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.post("/tokenize", json={"prompt": "Hi"})).status_code == 401
        families = await scrape(c, authorization=f"Bearer {key}")
    assert value(families, "pdcluster_http_responses_total", endpoint="/metrics", status_class="4xx") == 1
    assert value(families, "pdcluster_http_responses_total", endpoint="/tokenize", status_class="4xx") == 1


async def test_each_app_has_its_own_registry(backend, tokenizer):
    async with client_of(make_app(backend, tokenizer)) as first, client_of(make_app(backend, tokenizer)) as second:
        await first.post("/v1/completions", json={"prompt": "Hi"})
        assert value(await scrape(second), "pdcluster_ttft_seconds_count") == 0
        assert value(await scrape(first), "pdcluster_ttft_seconds_count") == 1


async def test_admission_counters(backend, tokenizer):
    admission = Admission(ttft_slo_s=1.0, max_in_flight=1)
    ticket = admission.place(100, prefill_live=1, decode_live=1)
    with pytest.raises(Exception, match="max_in_flight"):
        admission.place(100, prefill_live=1, decode_live=1)
    async with client_of(app_with(backend, tokenizer, GatewayMetrics(admission_view=admission.view))) as c:
        families = await scrape(c)
        assert value(families, "pdcluster_admission_in_flight") == 1
        assert value(families, "pdcluster_admission_queued_tokens", pool="prefill") == 100
        assert value(families, "pdcluster_admission_rejections_total", reason="in_flight_cap") == 1
        assert value(families, "pdcluster_admission_rejections_total", reason="slo") == 0
        assert value(families, "pdcluster_admission_admitted_total") == 1  # the refused one is not counted
        assert value(families, "pdcluster_admission_past_prediction_total") == 0
        assert value(families, "pdcluster_admission_prompt_tokens_total") == 100
        ticket.close()
        assert value(await scrape(c), "pdcluster_admission_in_flight") == 0


def status(role: str, name: str, **kw) -> dict:
    return {"name": name, "role": role, "engine_alive": True, "running": 2, "waiting": 1, "awaiting_kv": 1,
            "kv_blocks_total": 100, "kv_blocks_free": 60, "kv_blocks_cached": 10, "prompt_tokens_computed": 300,
            "prompt_tokens_cached": 64, **kw}


class FakeBoard:
    def __init__(self, statuses: list[dict] | None):
        self.statuses, self.reads = statuses, 0

    async def read(self) -> list[dict] | None:
        self.reads += 1
        return self.statuses


async def test_replica_numbers_from_the_status_board(backend, tokenizer):
    board = FakeBoard([status("prefill", "prefill-a"), status("decode", "decode-a", kv_blocks_free=90),
                       status("decode", "decode-b", kv_blocks_total="many"), {"role": "decode"}])
    async with client_of(app_with(backend, tokenizer, GatewayMetrics(board=board))) as c:
        families = await scrape(c)
    pa, da = {"pool": "prefill", "replica": "prefill-a"}, {"pool": "decode", "replica": "decode-a"}
    assert value(families, "pdcluster_kv_blocks_used", **pa) == 40
    assert value(families, "pdcluster_kv_blocks_used", **da) == 10
    assert value(families, "pdcluster_kv_blocks_total", **da) == 100
    assert value(families, "pdcluster_requests_running", **pa) == 2
    assert value(families, "pdcluster_requests_waiting", **pa) == 2
    assert value(families, "pdcluster_prompt_tokens_total", **pa) == 364
    assert value(families, "pdcluster_prefix_cache_hit_tokens_total", **pa) == 64
    # The malformed statuses are skipped, not the scrape.
    assert {s.labels["replica"] for s in families["pdcluster_kv_blocks_used"]} == {"prefill-a", "decode-a"}


async def test_without_a_board_the_replica_gauges_are_absent(client, backend, tokenizer):
    assert "pdcluster_kv_blocks_used" not in await scrape(client)
    async with client_of(app_with(backend, tokenizer, GatewayMetrics(board=FakeBoard(None)))) as c:
        families = await scrape(c)
    assert "pdcluster_kv_blocks_used" not in families and "pdcluster_http_responses" in families


async def test_an_unreachable_redis_is_read_once_a_second_and_reads_as_unknown():
    reader = StatusBoardReader("redis://127.0.0.1:1/0", "c", max_age_s=60.0, timeout_s=0.3)
    fetch, attempts = reader._fetch, []

    async def counted():
        attempts.append(time.monotonic())
        return await fetch()

    reader._fetch = counted
    assert await reader.read() is None
    assert await reader.read() is None    # cached: no second attempt within max_age_s
    assert len(attempts) == 1
    assert await StatusBoardReader(None, "c").read() is None
    assert await StatusBoardReader("memory://", "c").read() is None


async def test_the_real_board_that_replicas_publish(backend, tokenizer):
    redis_server = pytest.importorskip("pdcluster.prefix_store.redis_server")
    try:
        server = redis_server.RedisServer().start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    from pdcluster.services.pools.status_board import publish_forever

    publishers = [asyncio.create_task(publish_forever(server.url, "unit", s["name"], lambda s=s: s))
                  for s in (status("prefill", "prefill-x"), status("decode", "decode-y", kv_blocks_free=0))]
    reader = StatusBoardReader(server.url, "unit", max_age_s=0.0)
    try:
        async with client_of(app_with(backend, tokenizer, GatewayMetrics(board=reader))) as c:
            for _ in range(50):
                families = await scrape(c)
                if len(families.get("pdcluster_kv_blocks_used", [])) == 2:
                    break
                await asyncio.sleep(0.05)
        assert value(families, "pdcluster_kv_blocks_used", pool="prefill", replica="prefill-x") == 40
        assert value(families, "pdcluster_kv_blocks_used", pool="decode", replica="decode-y") == 100
    finally:
        for task in publishers:
            task.cancel()
        await asyncio.gather(*publishers, return_exceptions=True)
        await reader.aclose()
        server.stop()


async def test_the_board_is_read_at_most_once_per_max_age():
    reader = StatusBoardReader("redis://127.0.0.1:1/0", "c", max_age_s=60.0)
    fetches = 0

    async def fetch() -> list[dict]:
        nonlocal fetches
        fetches += 1
        return [status("decode", "d")]

    reader._fetch = fetch   # type: ignore[method-assign]
    assert await reader.read() == await reader.read() == [status("decode", "d")]
    assert fetches == 1


async def test_a_failing_metric_never_fails_the_request(backend, tokenizer, caplog):
    app = make_app(backend, tokenizer)
    sink: GatewayMetrics = app.state.gateway_metrics

    def broken(*_):
        raise RuntimeError("registry broke")

    sink._ttft.observe = sink._e2e.observe = sink._responses.labels = broken   # type: ignore[method-assign]
    async with client_of(app) as c:
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json={"messages": CHAT, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert sum("pdcluster_ttft_seconds" in m for m in caplog.messages) == 1   # logged once


async def test_closing_the_observed_stream_closes_the_backends():
    closed = asyncio.Event()

    async def backend_stream():
        try:
            for i in range(10):
                yield TokenDelta([i], "x")
        finally:
            closed.set()

    observed = GatewayMetrics().observe_stream(backend_stream())
    assert (await anext(observed)).token_ids == [0]
    await observed.aclose()
    assert closed.is_set()
