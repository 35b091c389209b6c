"""Every client mistake answers 4xx with an OpenAI-style body naming the
fix, before the backend is called; backend errors keep their status (429
with Retry-After, 503, 502); a stream that fails mid-way ends with an error
event and [DONE]."""

from __future__ import annotations

import httpx
import pytest
from openai_fakes import CHAT, assert_openai_error, make_app, sse_events

from pdcluster.services.backend import BackendFailure, BackendInvalidRequest, BackendOverloaded, BackendUnavailable
from pdcluster.services.openai.errors import client_message

MSGS = [{"role": "user", "content": "Hi"}]
C, CC = "/v1/completions", "/v1/chat/completions"

# (endpoint, JSON body, status, param the error names)
BAD_JSON_BODIES = [
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": ["a", "b"]}, 400, "prompt"),                     # batches of prompts
    (C, {"prompt": [[1, 2]]}, 400, "prompt"),
    (C, {"prompt": [1, -5]}, 400, "prompt"),
    (C, {"prompt": [10**7]}, 400, "prompt"),                         # outside the vocabulary
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {}, 400, "prompt"),
    (C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": -3}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "max_tokens": 2.5}, 400, "max_tokens"),
    (C, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": "Hi", "stop": 5}, 400, "stop"),
    (C, {"prompt": "Hi", "stop": [1, 2]}, 400, "stop"),
    (C, {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "Hi", "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "stream_options.include_usage"),
    (C, {"prompt": "Hi", "seed": 2**70}, 400, "seed"),
    (C, {"prompt": "Hi", "n": 17}, 400, "n"),
    (C, {"prompt": "Hi", "n": 0}, 400, "n"),
    (C, {"prompt": "Hi", "best_of": 3}, 400, "best_of"),
    (C, {"prompt": "Hi", "n": 3, "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "Hi", "logprobs": -1}, 400, "logprobs"),
    (C, {"prompt": "Hi", "echo": "yes"}, 400, "echo"),
    (C, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),       # 0 only with echo
    (C, {"prompt": "Hi", "suffix": "end"}, 400, "suffix"),
    (C, {"prompt": "Hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "Hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    (C, {"prompt": "Hi", "logit_bias": {"token": -100}}, 400, "logit_bias"),
    (C, {"prompt": "Hi", "max_token": 5}, 400, "max_token"),          # a typo is not silently ignored
    (C, {"prompt": "Hi", "model": "gpt-4o"}, 404, "model"),
    (C, {"prompt": "Hi", "model": 7}, 400, "model"),
    (CC, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CC, {"messages": []}, 400, "messages"),
    (CC, {"messages": "Hi"}, 400, "messages"),
    (CC, {}, 400, "messages"),
    (CC, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CC, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    (CC, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CC, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    (CC, {"messages": MSGS, "n": 17}, 400, "n"),
    (CC, {"messages": MSGS, "logprobs": 1}, 400, "logprobs"),
    (CC, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CC, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs"),   # needs logprobs: true
    (CC, {"messages": MSGS, "echo": True}, 400, "echo"),
    (CC, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools[0].function.name"),
    (CC, {"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    (CC, {"messages": MSGS, "functions": [{"name": "f"}]}, 400, "functions"),
    (CC, {"messages": MSGS, "response_format": {"type": "xml"}}, 400, "response_format"),
    (CC, {"messages": MSGS, "temperature": -1}, 400, "temperature"),
    (CC, {"messages": MSGS, "top_p": 1.5}, 400, "top_p"),
    (CC, {"messages": MSGS, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_JSON_BODIES,
                         ids=[f"{'chat' if p == CC else 'completions'}-{param}-{i}"
                              for i, (p, _, _, param) in enumerate(BAD_JSON_BODIES)])
async def test_bad_request_bodies(client, backend, path, body, status, param):
    assert_openai_error(await client.post(path, json=body), status, param)
    assert backend.requests == []


@pytest.mark.parametrize("raw", [b'{"prompt": "Hi"', b"", b"   ", b"[1, 2]", b'"Hi"', b"\xff\xfe",
                                 b'{"prompt": "Hi", "temperature": NaN}', b"[" * 30_000 + b"]" * 30_000])
async def test_malformed_json(client, backend, raw):
    r = await client.post(C, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)
    assert backend.requests == []


async def test_context_length_errors_name_both_numbers(client, backend, tokenizer):
    ids = list(range(1000, 1500))      # 500 tokens; the fake's context is 512
    err = assert_openai_error(await client.post(C, json={"prompt": ids, "max_tokens": 20}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert all(s in err["message"] for s in ("500", "20", "512", "at most 12"))
    err = assert_openai_error(await client.post(C, json={"prompt": list(range(1000, 1600))}), 400, "prompt")
    assert "600" in err["message"] and "512" in err["message"]
    long_chat = [{"role": "user", "content": "word " * 600}]
    err = assert_openai_error(await client.post(CC, json={"messages": long_chat}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    assert backend.requests == []


async def test_oversized_body_is_413_declared_or_streamed(client, backend):
    big = {"prompt": "x " * 40_000}                 # > MAX_BODY_BYTES (64 KiB)
    err = assert_openai_error(await client.post(C, json=big), 413)
    assert err["code"] == "request_too_large" and "65536" in err["message"]

    async def chunked():                           # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'
    assert_openai_error(await client.post(C, content=chunked()), 413)
    assert backend.requests == []


async def test_unknown_route_and_method(client):
    assert_openai_error(await client.post("/v1/embeddings", json={}), 404)
    assert_openai_error(await client.get(C), 405)


@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_is_429_with_retry_after(client, backend, stream):
    backend.script.raise_before = BackendOverloaded("prefill queue is full (64 waiting): retry later",
                                                    retry_after_s=2.5)
    r = await client.post(CC, json={"messages": CHAT, "stream": stream})
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    # The backend's own text is logged, not told (test_openai_error_privacy.py); the client gets cause and fix.
    assert r.json()["error"]["type"] == "rate_limit_error" and "capacity" in r.json()["error"]["message"]


@pytest.mark.parametrize("exc, status", [(BackendUnavailable("no live prefill replica"), 503),
                                         (BackendInvalidRequest("prompt needs 90 KV blocks, pool has 64"), 400),
                                         (BackendFailure("decode replica died"), 502)])
@pytest.mark.parametrize("stream", [False, True])
async def test_backend_errors_before_first_token_keep_their_status(client, backend, exc, status, stream):
    backend.script.raise_before = exc
    r = await client.post(C, json={"prompt": "Hi", "stream": stream})
    assert r.status_code == status and r.json()["error"]["message"] == client_message(exc)


async def test_mid_stream_failure_ends_with_error_event_then_done(client, backend):
    backend.script.fail_at = 2
    r = await client.post(CC, json={"messages": CHAT, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "replica_failed" and "replica failed" in events[-2]["error"]["message"]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello,"


async def test_stream_without_finish_reason_is_an_error_not_a_silent_cut(client, backend):
    backend.script.omit_finish = True
    events = sse_events((await client.post(C, json={"prompt": "Hi", "stream": True})).text)
    assert events[-2]["error"]["code"] == "replica_failed" and events[-1] == "[DONE]"
    r = await client.post(C, json={"prompt": "Hi"})
    assert r.status_code == 502 and "finish reason" in r.json()["error"]["message"]


async def test_a_backend_bug_is_a_500_with_an_openai_body_and_request_id(backend, tokenizer):
    backend.script.raise_before = RuntimeError("bug in the backend")
    transport = httpx.ASGITransport(app=make_app(backend, tokenizer), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
        for stream in (False, True):
            r = await c.post(C, json={"prompt": "Hi", "stream": stream})
            assert r.status_code == 500 and r.headers["x-request-id"]
            assert r.json()["error"]["type"] == "server_error" and "bug" not in r.json()["error"]["message"]
