"""asyncio front of the engine.

One thread owns the ``Engine`` and runs its step loop; every mutation
(add, abort, reserve/commit external KV, lease release) is a command queued
to that thread and applied between steps, so the event loop never waits on
a forward pass and the engine needs no lock.  Outputs come back to each
request's ``asyncio.Queue`` through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from services.engine.engine import Engine
from services.engine.errors import EngineDeadError, InvalidRequestError
from services.engine.outputs import EngineStats, ExternalKVAllocation, RequestOutput
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_POLL_S = 0.05  # how often an idle loop wakes to expire leases


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._dead: BaseException | None = None
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- commands ------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> "asyncio.Future[T]":
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}; restart the replica")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((fn, fut))
        self._wake.set()
        return asyncio.wrap_future(fut)

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps."""
        return await self._call(lambda: fn(self.engine))

    # ---- requests ------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                       prefill_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Streams a request's outputs; leaving early aborts it."""
        queue = self._open_stream(request_id)
        try:
            await self._call(lambda: self.engine.add_request(request_id, prompt, params, prefill_only))
            async for out in self._drain(request_id, queue):
                yield out
        finally:
            await self._close_stream(request_id)

    async def reserve_external(self, request_id: str, prompt_token_ids: Sequence[int],
                               params: SamplingParams) -> ExternalKVAllocation | None:
        return await self._call(lambda: self.engine.reserve_external(request_id, prompt_token_ids, params))

    async def decode_external(self, request_id: str, first_token_id: int) -> AsyncIterator[RequestOutput]:
        """After the reserved blocks were filled: streams the decode."""
        queue = self._open_stream(request_id)
        try:
            req = await self._call(lambda: self.engine.commit_external(request_id, first_token_id))
            if req.is_finished:
                return
            async for out in self._drain(request_id, queue):
                yield out
        finally:
            await self._close_stream(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.abort(request_id))

    async def release_lease(self, request_id: str) -> bool:
        return await self._call(lambda: self.engine.release_lease(request_id))

    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already streaming; pick a unique id")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        while True:
            item = await queue.get()
            # Outputs that piled up while this consumer was busy leave as one:
            # when the event loop falls behind the engine, fewer, larger
            # messages go through Serve instead of a growing backlog.
            while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
                later = queue.get_nowait()
                if isinstance(later, BaseException):
                    queue.put_nowait(later)  # terminal; raised on the next turn
                    break
                item = item.followed_by(later)
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def _close_stream(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None and self._dead is None:
            # Not finished (consumer left or error): abort; a no-op if it ended.
            await asyncio.shield(self._call(lambda: self.engine.abort(request_id)))

    # ---- the engine thread ------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self.engine.leases.expire()
                    self.stats = self.engine.stats()
                    self._wake.wait(_IDLE_POLL_S)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self.stats = self.engine.stats()
                self._deliver_step(outputs)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            log.exception("engine loop died")
            self._dead = exc
            self._deliver_all([(rid, EngineDeadError(f"engine loop died: {exc!r}")) for rid in self._streams])
            for _, fut in self._commands:
                fut.set_exception(EngineDeadError(f"engine loop died: {exc!r}"))

    def _apply_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        self._deliver_all([(out.request_id, out) for out in outputs])
        for out in outputs:
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """Hands each (request id, item) to its stream, in one callback per
        event loop (one wake-up per step rather than one per sequence)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                batches.setdefault(stream[0], []).append((stream[1], item))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed
                pass

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
