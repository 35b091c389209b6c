"""Tenants on the OpenAI API (issue 38, first part): a request's tenant is
its API key's (a key of no tenant is 'default'), or with the trusted header
the name it carries; each tenant's rate limits answer 429 with Retry-After
naming the tenant and its limit, while other tenants are served; answers
are counted per tenant at /metrics.  Through httpx's ASGI transport, with a
hand-driven clock for the buckets."""

from __future__ import annotations

import httpx
import pytest
from openai_fakes import MODEL, FakeBackend, make_app

from pdcluster.services.config import ClusterConfig, api_key_digest
from pdcluster.services.openai.rate_limits import TenantLimit, TenantRateLimits

ALICE, BOB, PLAIN = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef01", "sk-plain-0123456789abcdef"
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def app_with_tenants(backend, tokenizer, clock, trust_header=False, **limits):
    digests = {api_key_digest(ALICE): "alice", api_key_digest(BOB): "bob"}
    app = make_app(backend, tokenizer, api_key_digests=(*digests, api_key_digest(PLAIN)),
                   tenant_of_digest=digests, trust_tenant_header=trust_header, tenant_names=("alice", "bob"))
    app.state.rate_limits = TenantRateLimits([TenantLimit("alice", **limits), TenantLimit("bob")], clock)
    return app


def post(client, key, **headers):
    return client.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}", **headers})


async def test_a_tenant_over_its_request_rate_gets_429_naming_it_while_others_are_served(backend: FakeBackend,
                                                                                         tokenizer):
    clock = Clock()
    app = app_with_tenants(backend, tokenizer, clock, requests_per_s=2.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert [(await post(c, ALICE)).status_code for _ in range(2)] == [200, 200]
        refused = await post(c, ALICE)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        err = refused.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
        assert "tenant 'alice' is over its limit of 2 requests/s" in err["message"]
        assert [(await post(c, key)).status_code for key in (BOB, PLAIN, BOB)] == [200, 200, 200]
        clock.now += 0.5                          # one request's worth refilled
        assert (await post(c, ALICE)).status_code == 200
        metrics = (await c.get("/metrics", headers={"authorization": f"Bearer {PLAIN}"})).text
    assert 'pdcluster_tenant_requests_total{outcome="rate_limited",tenant="alice"} 1.0' in metrics
    assert 'pdcluster_tenant_requests_total{outcome="admitted",tenant="alice"} 3.0' in metrics
    assert 'pdcluster_tenant_requests_total{outcome="admitted",tenant="default"} 1.0' in metrics


async def test_a_token_rate_counts_prompt_and_max_tokens(backend: FakeBackend, tokenizer):
    clock = Clock()
    app = app_with_tenants(backend, tokenizer, clock, tokens_per_s=20.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        big = {**BODY, "max_tokens": 15}      # a few prompt tokens + 15: most of the 20-token bucket
        assert (await c.post("/v1/completions", json=big, headers={"authorization": f"Bearer {ALICE}"})).status_code == 200
        refused = await c.post("/v1/completions", json=big, headers={"authorization": f"Bearer {ALICE}"})
        assert refused.status_code == 429 and "20 tokens/s" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1


@pytest.mark.parametrize("trust, expected", [(False, 200), (True, 429)])
async def test_the_tenant_header_counts_only_when_trusted(backend: FakeBackend, tokenizer, trust, expected):
    clock = Clock()
    app = app_with_tenants(backend, tokenizer, clock, trust_header=trust, requests_per_s=1.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert (await post(c, ALICE)).status_code == 200                  # alice's one request per second
        # bob's key, naming alice: alice's limit applies only when the header is trusted
        assert (await post(c, BOB, **{"x-pdcluster-tenant": "alice"})).status_code == expected


def test_tenant_config_folds_keys_into_digests_and_refuses_ambiguity():
    cfg = ClusterConfig(tenants=[{"name": "alice", "api_keys": [ALICE], "requests_per_s": 5}])
    assert cfg.tenants[0].api_key_digests == (api_key_digest(ALICE),)
    assert api_key_digest(ALICE) in cfg.api_key_digests        # a tenant's key is a key of the cluster
    assert ALICE not in cfg.model_dump_json()
    with pytest.raises(ValueError, match="two tenants"):
        ClusterConfig(tenants=[{"name": "a", "api_keys": [ALICE]}, {"name": "b", "api_keys": [ALICE]}])
    with pytest.raises(ValueError, match="unique and not 'default'"):
        ClusterConfig(tenants=[{"name": "default"}])
    with pytest.raises(ValueError):
        ClusterConfig(tenants=[{"name": "bad name"}])


async def test_a_tenant_cannot_ask_more_urgent_than_its_min_priority(backend: FakeBackend, tokenizer):
    app = make_app(backend, tokenizer, api_key_digests=(api_key_digest(ALICE), api_key_digest(BOB)),
                   tenant_of_digest={api_key_digest(ALICE): "alice", api_key_digest(BOB): "bob"},
                   tenant_names=("alice", "bob"), tenant_min_priority={"alice": 0})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        for key in (ALICE, BOB):
            r = await c.post("/v1/completions", json={**BODY, "priority": -10},
                             headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        bad = await c.post("/v1/completions", json={**BODY, "priority": 10**9},
                           headers={"authorization": f"Bearer {BOB}"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
    assert [r.params.priority for r in backend.requests] == [0, -10]   # alice raised to 0; bob as asked


async def test_each_request_names_its_tenant_and_admission_429s_count_per_tenant(backend: FakeBackend, tokenizer):
    from pdcluster.services.backend import BackendOverloaded, for_client

    app = app_with_tenants(backend, tokenizer, Clock())
    auth = {"authorization": f"Bearer {PLAIN}"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert [(await post(c, key)).status_code for key in (ALICE, BOB)] == [200, 200]
        backend.script.raise_before = for_client(BackendOverloaded("predicted TTFT over the SLO", retry_after_s=3))
        refused = await post(c, ALICE)
        metrics = (await c.get("/metrics", headers=auth)).text
    assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
    assert [r.params.tenant for r in backend.requests] == ["alice", "bob", "alice"]
    assert 'pdcluster_tenant_requests_total{outcome="shed",tenant="alice"} 1.0' in metrics
    assert 'pdcluster_tenant_ttft_seconds_count{tenant="bob"} 1.0' in metrics
    assert 'pdcluster_tenant_tokens_total{kind="prompt",tenant="alice"}' in metrics
    assert 'pdcluster_tenant_tokens_total{kind="generation",tenant="bob"} 2.0' in metrics
