"""Fixtures for the OpenAI HTTP layer: the real SmolLM2 tokenizer (from the
GGUF, no weights), a FakeBackend, the app over httpx's ASGI transport, and
the same app served by uvicorn on 127.0.0.1 for the official client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest
from openai_fakes import FakeBackend, make_app, serve_app

from pdcluster.services.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    from transformers import AutoTokenizer

    from pdcluster.services.default_model import default_model_path

    path = default_model_path()
    return Tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), eos_token_ids=())


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def client(backend: FakeBackend, tokenizer: Tokenizer) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(backend, tokenizer))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as c:
        yield c


@dataclass
class LiveServer:
    base_url: str
    backend: FakeBackend


@pytest.fixture(scope="module")
def _live_server(tokenizer: Tokenizer) -> Iterator[LiveServer]:
    backend = FakeBackend()
    with serve_app(make_app(backend, tokenizer)) as base_url:
        yield LiveServer(base_url, backend)


@pytest.fixture
def live(_live_server: LiveServer) -> LiveServer:
    _live_server.backend.reset()
    return _live_server
