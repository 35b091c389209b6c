"""API keys on the OpenAI API (pdcluster/services/openai/auth.py): with keys set, every
path but /health and /openapi.json needs `Authorization: Bearer <key>`; a
refusal is a 401 OpenAI body with WWW-Authenticate that never echoes what was
sent, and no key reaches a log.  Through httpx's ASGI transport and through
the official openai client against uvicorn."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import openai
import pytest
from openai_fakes import MODEL, FakeBackend, make_app, serve_app, sse_events

from pdcluster.services.config import api_key_digest
from pdcluster.services.openai import auth

KEYS = ("sk-test-first-0123456789abcdef", "sk-test-second-fedcba9876543210")
WRONG = "sk-test-wrong-00000000000000000"
MESSAGES = [{"role": "user", "content": "Say hello."}]
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
async def authed(backend: FakeBackend, tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(backend, tokenizer, api_key_digests=tuple(api_key_digest(k) for k in KEYS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        yield c


def assert_refused(r: httpx.Response, *sent: str) -> dict:
    """A 401 OpenAI error body with a Bearer challenge, echoing nothing of ``sent``."""
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.headers["x-request-id"]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key" and err["param"] is None
    assert set(err) == {"message", "type", "param", "code"} and "key" in err["message"]
    for secret in (*KEYS, *sent):
        assert secret not in r.text and secret not in str(r.headers)
    return err


@pytest.mark.parametrize("headers", [
    {},                                                   # no header
    bearer(WRONG),                                        # a wrong key
    bearer(KEYS[0] + "x"),                                # a right key's prefix is not enough
    bearer(KEYS[0][:-1]),
    {"authorization": KEYS[0]},                           # no scheme
    {"authorization": f"Basic {KEYS[0]}"},                # another scheme
    {"authorization": "Bearer"},                          # no token
    {"authorization": f"Bearer {KEYS[0]} {KEYS[1]}"},     # two tokens
    {"x-api-key": KEYS[0]},                               # not where a key is read from
], ids=["none", "wrong", "longer", "shorter", "no-scheme", "basic", "no-token", "two-tokens", "x-api-key"])
async def test_requests_without_a_right_key_get_401(authed, backend, headers):
    for method, path, body in (("POST", "/v1/completions", COMPLETION), ("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
                               ("GET", "/v1/nope", None), ("GET", "/metrics", None)):
        assert_refused(await authed.request(method, path, json=body, headers=headers), WRONG)
    assert backend.requests == []       # nothing reached the backend


async def test_the_challenge_says_why(authed):
    assert 'error="invalid_token"' in (await authed.get("/v1/models", headers=bearer(WRONG))).headers[
        "www-authenticate"]
    missing = await authed.get("/v1/models")
    assert "error=" not in missing.headers["www-authenticate"] and "no API key" in missing.json()["error"]["message"]


async def test_two_authorization_headers_are_refused(authed):
    r = await authed.get("/v1/models", headers=[("authorization", f"Bearer {KEYS[0]}"),
                                                ("authorization", f"Bearer {KEYS[1]}")])
    assert_refused(r)


@pytest.mark.parametrize("key", KEYS)
async def test_any_configured_key_is_let_in(authed, backend, key):
    assert (await authed.get("/v1/models", headers=bearer(key))).status_code == 200
    r = await authed.post("/v1/completions", json=COMPLETION, headers={"authorization": f"bearer   {key}"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello,"
    streamed = await authed.post("/v1/chat/completions", headers=bearer(key),
                                 json={"model": MODEL, "messages": MESSAGES, "stream": True})
    events = sse_events(streamed.text)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == \
        "Hello, world!"
    assert len(backend.requests) == 2


async def test_health_and_openapi_stay_open(authed, backend):
    assert (await authed.get("/health")).status_code == 200
    backend.health_status = {"status": "degraded", "reason": "no prefill replica"}
    assert (await authed.get("/health")).status_code == 503      # the backend's answer, not a 401
    schema = await authed.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    assert not any(k in schema.text for k in KEYS) and "sha256:" not in schema.text


async def test_without_keys_nothing_is_asked(client):
    assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
    assert (await client.get("/v1/models", headers=bearer(WRONG))).status_code == 200


async def test_unconfigured_app_refuses_before_it_knows_its_keys():
    from pdcluster.services.openai import create_app

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app()), base_url="http://g") as c:
        r = await c.get("/v1/nope", headers=bearer(KEYS[0]))
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


async def test_no_key_reaches_the_logs(authed, caplog):
    caplog.set_level(logging.DEBUG)
    for headers in ({}, bearer(WRONG), {"authorization": f"Basic {KEYS[1]}"}, bearer(KEYS[0])):
        await authed.post("/v1/completions", json=COMPLETION, headers=headers)
    assert "refused POST /v1/completions" in caplog.text     # refusals are logged, at debug, without the key
    for secret in (*KEYS, WRONG, api_key_digest(KEYS[0])):
        assert secret not in caplog.text


def test_every_digest_is_compared_whichever_matches(monkeypatch):
    digests = tuple(api_key_digest(k) for k in (*KEYS, WRONG))
    calls = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(b) or real(a, b))
    for token, expected in ((KEYS[0], True), (WRONG, True), (KEYS[1] + "!", False)):
        calls.clear()
        assert auth.key_matches(token.encode(), digests) is expected
        assert calls == list(digests)


# -- the official client against uvicorn ----------------------------------------------------

@pytest.fixture(scope="module")
def authed_url(tokenizer) -> Iterator[str]:
    app = make_app(FakeBackend(), tokenizer, api_key_digests=tuple(api_key_digest(k) for k in KEYS))
    with serve_app(app) as base_url:
        yield base_url


def oai(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=10)


@pytest.mark.parametrize("key", KEYS)
def test_the_openai_clients_api_key_works_unchanged(authed_url, key):
    with oai(authed_url, key) as c:
        chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
        assert chat.choices[0].message.content == "Hello, world!"
        chunks = list(c.completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=2))
        assert "".join(p.choices[0].text for p in chunks) == "Hello,"
        assert [m.id for m in c.models.list()] == [MODEL]


def test_the_openai_client_with_a_wrong_key_gets_authentication_error(authed_url):
    with oai(authed_url, WRONG) as c:
        with pytest.raises(openai.AuthenticationError) as refused:
            c.chat.completions.create(model=MODEL, messages=MESSAGES)
        with pytest.raises(openai.AuthenticationError):
            list(c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
    assert WRONG not in str(refused.value) and not any(k in str(refused.value) for k in KEYS)
    assert httpx.get(f"{authed_url}/health", timeout=10).status_code == 200
