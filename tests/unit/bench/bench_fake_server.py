"""A tiny fake OpenAI-compatible SSE server for testing the bench client.

It is not a model: it counts whitespace words as prompt tokens and emits
``max_tokens`` tokens with a timing model the tests can predict:

    TTFT     = overhead_s + prompt_tokens / prefill_tok_s
    each gap = step_base_s + step_per_seq_s * (streams decoding right now)

Faults for error tests: every ``fail_every``-th request answers HTTP 500;
every ``break_every``-th stream is cut halfway without [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeConfig:
    overhead_s: float = 0.002
    prefill_tok_s: float = 200_000.0
    step_base_s: float = 0.002
    step_per_seq_s: float = 0.0002
    fail_every: int = 0
    break_every: int = 0
    model: str = "fake-model"
    chat: bool = True


@dataclass
class FakeState:
    config: FakeConfig
    requests: int = 0
    decoding: int = 0
    bodies: list[dict] = field(default_factory=list)


STATE = web.AppKey("state", FakeState)


def _prompt_tokens(body: dict) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


def _chunk(body: dict, text: str, finish: str | None) -> dict:
    if "messages" in body:
        choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"object": "chat.completion.chunk", "choices": [choice]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def _send(response: web.StreamResponse, data) -> None:
    payload = data if isinstance(data, str) else json.dumps(data)
    await response.write(f"data: {payload}\n\n".encode())


async def completions(request: web.Request) -> web.StreamResponse:
    state: FakeState = request.app[STATE]
    cfg = state.config
    body = await request.json()
    state.requests += 1
    state.bodies.append(body)
    number = state.requests
    if cfg.fail_every and number % cfg.fail_every == 0:
        return web.json_response({"error": {"message": "injected failure"}}, status=500)
    n_in, n_out = _prompt_tokens(body), int(body["max_tokens"])
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if "messages" in body:
        await _send(response, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    await asyncio.sleep(cfg.overhead_s + n_in / cfg.prefill_tok_s)
    state.decoding += 1
    try:
        for i in range(n_out):
            if i:
                await asyncio.sleep(cfg.step_base_s + cfg.step_per_seq_s * state.decoding)
            if cfg.break_every and number % cfg.break_every == 0 and i == n_out // 2:
                request.transport.close()
                return response
            await _send(response, _chunk(body, " tok", "length" if i == n_out - 1 else None))
    finally:
        state.decoding -= 1
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        await _send(response, {"choices": [], "usage": usage})
    await _send(response, "[DONE]")
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": request.app[STATE].config.model, "object": "model"}]})


def make_app(config: FakeConfig) -> web.Application:
    app = web.Application()
    app[STATE] = FakeState(config)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    return app


@contextlib.contextmanager
def fake_server(config: FakeConfig | None = None):
    """Serve on 127.0.0.1 (free port) in a background thread; yields (url, state)."""
    app = make_app(config or FakeConfig())
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    ready = threading.Event()
    holder: dict = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("fake server did not start within 10 s")
    try:
        yield f"http://127.0.0.1:{holder['port']}", app[STATE]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        time.sleep(0)
