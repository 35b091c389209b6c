"""The load generator: sends a workload's requests to an OpenAI-compatible
server and collects one ``RequestRecord`` per request.

    producer (thread) ── builds prompts ahead ──> queue ──┬─> open loop: dispatcher sleeps
                                                          │   until each arrival_s, then sends
                                                          └─> closed loop: N workers, each
                                                              sends its next request when the
                                                              previous one finishes
A run ends when the schedule is exhausted (request count, or open-loop
arrivals past the duration) or, in a closed loop, when the duration has
passed; requests already in flight always finish.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass

import aiohttp

from bench.load.client import RequestRecord, endpoint_url, models_url, request_body, send_request
from bench.progress import RunProgress
from bench.load.prompts import PromptBuilder
from bench.load.schedule import RequestPlan, request_plans
from bench.tokenizer import TextTokenizer
from bench.workload import Closed, Workload

_QUEUE_AHEAD = 64


@dataclass
class RunResult:
    workload: Workload
    url: str
    model: str
    tokenizer: str
    started_at: str  # ISO time, UTC
    duration_s: float  # first send to last completion
    records: list[RequestRecord]


@dataclass(frozen=True)
class _Ready:
    plan: RequestPlan
    body: dict
    prompt_tokens: int


async def resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists at /v1/models."""
    url = models_url(base_url)
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            response.raise_for_status()
            models = (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise RuntimeError(f"cannot list models at {url} ({exc}): is the server up? (or name the served model: bench --model NAME)") from exc
    if not models:
        raise RuntimeError(f"{url} lists no models: name the served model (bench --model NAME)")
    return str(models[0]["id"])


def _build(workload: Workload, builder: PromptBuilder, model: str, plan: RequestPlan) -> _Ready:
    prompt = builder.build(plan)
    body = request_body(workload.request, model, prompt, plan.output_tokens)
    return _Ready(plan, body, prompt.num_tokens)


async def _produce(
    workload: Workload,
    builder: PromptBuilder,
    model: str,
    queue: asyncio.Queue,
    started: asyncio.Event,
    failures: list[Exception],
) -> None:
    """Fills ``queue`` with ready requests, then None; sets ``started`` once
    the first one is ready so the run clock does not include tokenizer warm-up."""
    try:
        for plan in request_plans(workload):
            await queue.put(await asyncio.to_thread(_build, workload, builder, model, plan))
            started.set()
    except Exception as exc:  # e.g. a tokenizer failure: end the run, then raise it
        failures.append(exc)
    await queue.put(None)
    started.set()


class _Runner:
    def __init__(self, session, url: str, workload: Workload, progress: RunProgress) -> None:
        self.session, self.url, self.workload, self.progress = session, url, workload, progress
        self.records: list[RequestRecord] = []
        self.t_start = time.perf_counter()

    async def send(self, ready: _Ready) -> None:
        self.progress.sent()
        record = await send_request(
            self.session, self.url, ready.body, ready.plan, ready.prompt_tokens, self.t_start, self.workload.request.timeout_s
        )
        self.records.append(record)
        self.progress.finished(record.ok)

    async def open_loop(self, queue: asyncio.Queue) -> None:
        in_flight: set[asyncio.Task] = set()
        while (ready := await queue.get()) is not None:
            delay = self.t_start + ready.plan.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self.send(ready))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.gather(*in_flight)

    async def closed_loop(self, queue: asyncio.Queue, concurrency: int) -> None:
        deadline = self.workload.stop.duration_s

        async def worker() -> None:
            while deadline is None or time.perf_counter() - self.t_start < deadline:
                ready = await queue.get()
                if ready is None:
                    await queue.put(None)  # let the other workers see the end too
                    return
                await self.send(ready)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _ticker(progress: RunProgress) -> None:
    while True:
        await asyncio.sleep(0.5)
        progress.tick()


async def run_workload(
    base_url: str,
    workload: Workload,
    tokenizer: TextTokenizer,
    *,
    show_progress: bool = True,
    label: str | None = None,
    api_key: str | None = None,
    fresh_connections: bool = False,
) -> RunResult:
    """Run ``workload`` against ``base_url`` and return every request's record
    (``api_key``: sent as a bearer token; it names the tenant on a cluster with tenants).
    ``fresh_connections``: one TCP connection per request, no keep-alive; for servers that close an idle
    kept-alive connection as the client reuses it (llama-server: "Can not write request body")."""
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        model = workload.model or await resolve_model(session, base_url)
        builder = PromptBuilder(workload, tokenizer)
        queue: asyncio.Queue = asyncio.Queue(maxsize=_QUEUE_AHEAD)
        started, failures = asyncio.Event(), []
        producer = asyncio.create_task(_produce(workload, builder, model, queue, started, failures))
        await started.wait()
        progress = RunProgress(label or workload.name, workload.stop.num_requests, workload.stop.duration_s, show_progress)
        started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        with progress:
            ticker = asyncio.create_task(_ticker(progress))
            runner = _Runner(session, endpoint_url(base_url, workload.request), workload, progress)
            try:
                if isinstance(workload.arrival, Closed):
                    await runner.closed_loop(queue, workload.arrival.concurrency)
                else:
                    await runner.open_loop(queue)
            finally:
                ticker.cancel()
                producer.cancel()
            duration_s = time.perf_counter() - runner.t_start
    if failures:
        raise RuntimeError(f"building prompts failed: {failures[0]}") from failures[0]
    records = sorted(runner.records, key=lambda r: r.index)
    return RunResult(workload, base_url, model, tokenizer.name, started_at, duration_s, records)
