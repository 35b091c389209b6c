"""The app served by uvicorn on 127.0.0.1, driven by the official ``openai``
client (chat and completions, streaming and not, usage, errors) and by raw
httpx for client disconnects, which must close the backend's generator."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai_fakes import MODEL

from pdcluster.services.backend import BackendOverloaded

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture
def oai(live) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


def test_chat_and_completions_through_the_openai_client(oai, live, tokenizer):
    n = len(tokenizer.apply_chat_template(MESSAGES))
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == "Hello, world!" and chat.choices[0].finish_reason == "stop"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (n, 4, n + 4)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0

    text = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, seed=1, stop=["\n"])
    assert text.choices[0].text == "Hello, world" and text.choices[0].finish_reason == "length"
    assert text.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert live.backend.requests[1].params.stop == ("\n",)


def test_streaming_through_the_openai_client(oai, live):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-2].choices[0].finish_reason == "stop"

    pieces = list(oai.completions.create(model=MODEL, prompt="Hi", stream=True, max_tokens=2))
    assert "".join(p.choices[0].text for p in pieces) == "Hello,"
    assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].usage is None


def test_errors_through_the_openai_client(oai, live):
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert missing.value.body["code"] == "model_not_found"

    live.backend.script.raise_before = BackendOverloaded("queue full: retry later", retry_after_s=1)
    with pytest.raises(openai.RateLimitError) as limited:
        oai.completions.create(model=MODEL, prompt="Hi")
    assert limited.value.response.headers["retry-after"] == "1"

    live.backend.script.raise_before, live.backend.script.fail_at = None, 1
    with pytest.raises(openai.APIError, match="a replica failed"):   # the backend's own text is only logged
        for _ in oai.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
            pass


def test_client_disconnect_mid_stream_closes_the_backend_generator(live):
    live.backend.script.hang_at = 2     # two tokens, then nothing until aborted
    body = {"model": MODEL, "prompt": "Hi", "stream": True, "max_tokens": 100}
    with httpx.Client(timeout=10) as c, c.stream("POST", f"{live.base_url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"text":"Hello"' in line:
                break               # leaving the block drops the connection mid-stream
    assert live.backend.aborted.wait(5), "the backend generator was not closed after the client left"
    assert not live.backend.finished.is_set()


def test_client_disconnect_while_waiting_closes_the_backend_generator(live):
    live.backend.script.hang_at = 0     # no first token yet (queued, or a long prefill)
    for stream in (False, True):
        live.backend.reset()
        live.backend.script.hang_at = 0
        body = {"model": MODEL, "messages": MESSAGES, "stream": stream}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        assert live.backend.aborted.wait(5), f"stream={stream}: the backend generator outlived its client"
