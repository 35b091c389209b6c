"""A scripted Backend for testing the HTTP layer (yields a few chunks, raises
any backend error on request, records how each generation ended), the app
built around it, uvicorn serving it, an SSE reader, and the check of an OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI

from pdcluster.services.backend import Backend, BackendError, BackendFailure
from pdcluster.services.messages import GenerateRequest, TokenDelta
from pdcluster.services.tokenizer import Tokenizer
from pdcluster.services.openai import OpenAISettings, configure_app, create_app

MODEL = "SmolLM2-135M-Instruct"
ANSWER = ["Hello", ",", " world", "!"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
HASH_SEED = 0x5EED
BLOCK_SIZE = 16
MAX_BODY_BYTES = 64 * 1024


@dataclass
class Script:
    pieces: list[str] = field(default_factory=lambda: list(ANSWER))  # one token each; the last ends with EOS
    raise_before: BackendError | None = None   # raised before the first chunk
    fail_at: int | None = None                 # BackendFailure instead of chunk #fail_at
    hang_at: int | None = None                 # wait forever instead of chunk #hang_at
    omit_finish: bool = False                  # end the stream without a finish_reason
    cached_tokens: int = 0


class FakeBackend(Backend):
    model_name = MODEL

    def __init__(self, max_model_len: int = 512):
        self.max_model_len = max_model_len
        self.health_status: dict = {"status": "ok"}
        self.reset()

    def reset(self) -> None:
        self.script = Script()
        self.requests: list[GenerateRequest] = []
        self.started = threading.Event()   # threading: the live-server tests watch from another thread
        self.aborted = threading.Event()   # closed or cancelled before its last chunk
        self.finished = threading.Event()

    async def health(self) -> dict:
        return self.health_status

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        self.started.set()
        s, done = self.script, False
        try:
            if s.raise_before is not None:
                raise s.raise_before
            n = min(len(s.pieces), request.params.max_tokens)
            for i in range(n):
                if s.fail_at == i:
                    raise BackendFailure("decode replica died mid-stream")
                if s.hang_at == i:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
                last = i == n - 1
                finish = None
                if last and not s.omit_finish:
                    finish = "length" if n < len(s.pieces) else "stop"
                yield TokenDelta([100 + i], s.pieces[i], finish, num_prompt_tokens=len(request.prompt_token_ids),
                                  num_cached_tokens=s.cached_tokens)
            done = True
        finally:
            (self.finished if done else self.aborted).set()


def make_app(backend: FakeBackend, tokenizer: Tokenizer, **overrides) -> FastAPI:
    app = create_app()
    settings = dict(served_model_names=(MODEL,), block_hash_seed=HASH_SEED, block_size=BLOCK_SIZE,
                    max_body_bytes=MAX_BODY_BYTES)
    configure_app(app, backend, tokenizer, OpenAISettings(**{**settings, **overrides}))
    return app


@contextmanager
def serve_app(app: FastAPI) -> Iterator[str]:
    """``app`` served by uvicorn on a free 127.0.0.1 port, in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a hang guard: the suite may run this starved (tests/conftest.py)
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start within 120 s"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def sse_events(text: str) -> list:
    """Every ``data:`` payload, JSON-decoded except the final ``[DONE]``."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """``r`` is a ``status`` answer with a whole OpenAI error body naming ``param``; returns the error."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    assert r.headers["x-request-id"]
    return err
