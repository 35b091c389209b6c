"""Client disconnects at the ASGI level, where the timing is exact: a client
that stops reading (a send that never returns) or whose socket fails (a
send that raises) must get the backend's generator closed before the app
returns -- not whenever the garbage collector gets to it."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai_fakes import FakeBackend, make_app

BODY = json.dumps({"prompt": "Hi", "stream": True, "max_tokens": 100}).encode()


def scope(spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "server": ("gateway", 80), "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_stuck_or_broken_client_closes_the_backend_generator(tokenizer, spec_version):
    backend = FakeBackend()
    backend.script.pieces = ["tok"] * 50
    app = make_app(backend, tokenizer)
    gone = asyncio.Event()
    sent: list[dict] = []
    body_read = False

    async def receive() -> dict:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and b'"tok"' in message.get("body", b""):
            gone.set()
            if spec_version == "2.4":
                raise OSError("connection reset by peer")
            await asyncio.Event().wait()    # 2.3: a client that stopped reading; only cancellation ends this

    await app(scope(spec_version), receive, send)   # inline: no loop turn for a GC finalizer to tidy up
    assert backend.aborted.is_set() and not backend.finished.is_set()
    assert sent[0]["status"] == 200
