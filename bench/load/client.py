"""One streamed request to an OpenAI-compatible server, timed token by token.

    send ──── TTFT ────┬ tok ─ gap ─ tok ─ gap ─ ... ─ tok ─ [DONE]
    └──────────────────────────── E2E ──────────────────────────┘
    TPOT = (E2E - TTFT) / (output_tokens - 1)

Every gap between successive token chunks is kept (inter-token latency).
Failures are recorded by kind, never raised: connect, timeout, http_<code>,
server_error (an error object in the stream), stream_broken (connection lost
mid-stream), truncated (stream ended without [DONE]), bad_response
(unparseable SSE data), no_tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from bench.load.prompts import Prompt
from bench.load.schedule import RequestPlan
from bench.workload import RequestOptions


@dataclass
class RequestRecord:
    index: int
    bucket: str
    tenant: str
    input_tokens: int  # server-reported prompt tokens, else our count
    output_tokens: int  # server-reported completion tokens, else token chunks
    planned_output_tokens: int
    start_s: float  # send time, seconds after run start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    error_detail: str = ""
    usage_reported: bool = False
    retry_after: str | None = None  # a refusal's Retry-After header

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(options: RequestOptions, model: str, prompt: Prompt, max_tokens: int) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.priority is not None:
        body["priority"] = options.priority
    if options.endpoint == "chat":
        messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
        body["messages"] = messages + [{"role": "user", "content": prompt.user}]
    else:
        body["prompt"] = prompt.text
    return body


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def endpoint_url(base_url: str, options: RequestOptions) -> str:
    return _v1(base_url) + ("/chat/completions" if options.endpoint == "chat" else "/completions")


def models_url(base_url: str) -> str:
    return _v1(base_url) + "/models"


def chunk_tokens(chunk: dict) -> int:
    """Token events in one SSE chunk: choices carrying generated text.  A
    chat role-only delta and a final empty chunk with a finish_reason are not
    tokens; an empty text mid-stream is (a token that decodes to nothing)."""
    count = 0
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            count += 1
        elif text == "" and choice.get("finish_reason") is None and not (isinstance(delta, dict) and "role" in delta):
            count += 1
    return count


def sse_data(lines: list[str]) -> str | None:
    """The data payload of one SSE event (its lines, blank line excluded)."""
    data = [line[5:].lstrip() if line.startswith("data:") else None for line in lines]
    data = [d for d in data if d is not None]
    return "\n".join(data) if data else None


def classify_exception(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return "stream_broken"
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return "bad_response"
    return type(exc).__name__


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord, sent: float) -> None:
    last_token_at: float | None = None
    chunks, event, done = 0, [], False
    async for raw in response.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line:
            event.append(line)
            continue
        payload, event = sse_data(event), []
        if payload is None:
            continue
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            record.error, record.error_detail = "server_error", str(chunk["error"])[:200]
            return
        now = time.perf_counter()
        tokens = chunk_tokens(chunk)
        if tokens:
            if last_token_at is None:
                record.ttft_s = now - sent
            else:
                record.itl_s.append(now - last_token_at)
            last_token_at, chunks = now, chunks + tokens
            if not record.usage_reported:
                record.output_tokens = chunks
        usage = chunk.get("usage")
        if usage:
            record.usage_reported = True
            record.input_tokens = int(usage.get("prompt_tokens", record.input_tokens))
            record.output_tokens = int(usage.get("completion_tokens", chunks))
    record.e2e_s = time.perf_counter() - sent
    if not done:
        record.error = "truncated"
    elif chunks == 0:
        record.error = "no_tokens"


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    plan: RequestPlan,
    prompt_tokens: int,
    t_start: float,
    timeout_s: float,
) -> RequestRecord:
    sent = time.perf_counter()
    record = RequestRecord(
        index=plan.index,
        bucket=plan.bucket,
        tenant=plan.tenant,
        input_tokens=prompt_tokens,
        output_tokens=0,
        planned_output_tokens=plan.output_tokens,
        start_s=sent - t_start,
    )
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=body, timeout=timeout) as response:
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_detail = (await response.text())[:200]
                record.retry_after = response.headers.get("retry-after")
            else:
                await _read_stream(response, record, sent)
    except Exception as exc:  # every failure becomes a recorded kind
        record.error = record.error or classify_exception(exc)
        record.error_detail = record.error_detail or str(exc)[:200]
    if record.e2e_s is None:  # failed requests keep their elapsed time too
        record.e2e_s = time.perf_counter() - sent
    return record
