"""The HTTP layer over httpx's ASGI transport with a FakeBackend and the real
SmolLM2 tokenizer: response shapes, usage, streaming, what reaches the
backend, x-request-id."""

from __future__ import annotations

import httpx
from openai_fakes import ANSWER, BLOCK_SIZE, CHAT, HASH_SEED, MODEL, FakeBackend, make_app, sse_events

from pdcluster.prefix_store.hashing import hash_prompt_blocks

async def test_chat_completion_applies_template_and_counts_usage(client, backend, tokenizer):
    backend.script.cached_tokens = 16
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 10})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = tokenizer.apply_chat_template(CHAT)
    assert backend.requests[0].prompt_token_ids == prompt_ids
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello, world!"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 4,
                             "total_tokens": len(prompt_ids) + 4, "prompt_tokens_details": {"cached_tokens": 16}}
    assert body["id"] == f"chatcmpl-{r.headers['x-request-id']}"


async def test_completion_text_and_token_prompts(client, backend, tokenizer):
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hello," and body["choices"][0]["finish_reason"] == "length"
    assert backend.requests[0].prompt_token_ids == tokenizer.encode("Once upon a time")
    assert body["usage"]["completion_tokens"] == 2

    ids = list(range(1000, 1040))
    r = await client.post("/v1/completions", json={"prompt": ids, "temperature": 0, "seed": 7, "stop": "x",
                                                   "ignore_eos": True, "top_k": -1})
    assert r.status_code == 200, r.text
    sent = backend.requests[1]
    assert sent.prompt_token_ids == ids
    assert sent.block_hashes == tuple(hash_prompt_blocks(HASH_SEED, ids, BLOCK_SIZE)) and len(sent.block_hashes) == 2
    p = sent.params
    assert (p.max_tokens, p.temperature, p.seed, p.stop, p.ignore_eos, p.top_k) == (16, 0.0, 7, ("x",), True, 0)
    assert r.json()["usage"]["prompt_tokens"] == 40


async def test_default_max_tokens(client, backend, tokenizer):
    await client.post("/v1/chat/completions", json={"messages": CHAT})
    n = len(tokenizer.apply_chat_template(CHAT))
    assert backend.requests[0].params.max_tokens == backend.max_model_len - n   # chat: the rest of the context
    await client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3, "max_tokens": 9})
    assert backend.requests[1].params.max_tokens == 3                         # max_completion_tokens wins


async def test_chat_stream_with_usage(client, backend, tokenizer):
    r = await client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "".join(ANSWER)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    n = len(tokenizer.apply_chat_template(CHAT))
    assert chunks[-1]["usage"]["prompt_tokens"] == n and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_continuous_usage_stats_on_every_chunk(client, tokenizer):
    """vLLM's extension (guidellm sends it): the usage so far on each token chunk."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "Hi"})):
        r = await client.post(path, json=body | {"stream": True, "stream_options": options})
        assert r.status_code == 200, r.text
        chunks = sse_events(r.text)[:-1]
        token_chunks = [c for c in chunks if c["choices"] and not c["choices"][0].get("delta", {}).get("role")]
        completion_tokens = [c["usage"]["completion_tokens"] for c in token_chunks]
        assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] >= 1, completion_tokens
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
                   for c in token_chunks)


async def test_completion_stream_without_usage(client):
    r = await client.post("/v1/completions", json={"prompt": "Hi", "stream": True, "max_tokens": 3})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "Hello, world"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert not any("usage" in e for e in events[:-1])


async def test_models_and_health(client, backend):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == MODEL and r.json()["data"][0]["max_model_len"] == backend.max_model_len
    assert (await client.get("/health")).json() == {"status": "ok"}
    backend.health_status = {"status": "degraded", "reason": "no decode replica"}
    assert (await client.get("/health")).status_code == 503


async def test_request_id_honoured_or_generated(client, backend):
    r = await client.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-request-id": "trace-42.a"})
    assert r.headers["x-request-id"] == "trace-42.a"
    assert backend.requests[0].request_id.startswith("trace-42.a-")   # unique even if a client repeats its id
    for bad in ("has spaces", "x" * 200, "semi;colon"):
        r = await client.get("/v1/models", headers={"x-request-id": bad})
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32
    r = await client.post("/v1/completions", json={"prompt": "Hi"})
    assert backend.requests[1].request_id == r.headers["x-request-id"]
    assert (await client.get("/nope")).headers["x-request-id"]


async def test_unconfigured_app_answers_503(tokenizer):
    from pdcluster.services.openai import create_app

    transport = httpx.ASGITransport(app=create_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
        r = await c.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"


async def test_several_served_names(tokenizer):
    app = make_app(FakeBackend(), tokenizer, served_model_names=("a", "b"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as c:
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == ["a", "b"]
        assert (await c.post("/v1/completions", json={"model": "b", "prompt": "Hi"})).json()["model"] == "b"
